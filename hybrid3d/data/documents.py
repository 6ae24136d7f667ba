"""Local data files as a `datasets.Dataset` of documents: text, json/jsonl, parquet, arrow, or a `save_to_disk`
folder."""

import glob
import os
from pathlib import Path

from hybrid3d.errors import ConfigError

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
            ".arrow": "arrow"}


def load_documents(path: str, key: str):
    """A `datasets.Dataset` of the file(s) or save_to_disk folder at `path` (one-line errors naming `key`)."""
    import datasets

    if os.path.isdir(path):
        if not (Path(path, "dataset_info.json").exists() or Path(path, "dataset_dict.json").exists()
                or Path(path, "state.json").exists()):
            raise ConfigError(f"{key}: {path} is a folder but not a datasets save_to_disk folder")
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"{key}: {path} has splits {sorted(loaded)} but no 'train'")
            loaded = loaded["train"]
        return loaded
    files = sorted(glob.glob(path))
    if not files:
        raise ConfigError(f"{key}: no file matches {path}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(f"{key}: {path} holds no documents (empty file)")
    suffixes = {Path(f).suffix.lower() for f in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise ConfigError(f"{key}: cannot read {', '.join(sorted(suffixes))} files "
                          f"(supported: {', '.join(sorted(BUILDERS))}, one kind at a time)")
    try:
        return datasets.load_dataset(builders.pop(), data_files=files, split="train")
    except Exception as e:  # datasets raises many types for malformed files
        raise ConfigError(f"{key}: cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None


def ordered_documents(path: str, key: str, shuffle: bool, seed: int):
    """The documents of `path`, after the optional seeded shuffle (`np.random.default_rng(seed).permutation`)."""
    documents = load_documents(path, key)
    if len(documents) == 0:
        raise ConfigError(f"{key}: {path} holds no documents")
    return documents.shuffle(seed=seed) if shuffle else documents
