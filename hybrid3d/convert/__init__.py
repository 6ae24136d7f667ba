"""Hugging Face Llama <-> hybrid3d (DeepSpeed) checkpoints, streamed tensor by tensor.

CLI: `python -m hybrid3d.convert hf2hybrid|hybrid2hf ...` (docs/convert.md). In Python:
`hybrid3d.convert.hf_to_hybrid.hf_to_hybrid` and `hybrid3d.convert.hybrid_to_hf.hybrid_to_hf`.
Nothing is imported here, so the CLI answers `--help` and argument errors without loading torch.
"""
