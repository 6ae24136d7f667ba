"""Fine-tuning data: which tokens are learned, how examples are packed, and bad data refused naming the row."""

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from hybrid3d.config.sections import DataSection
from hybrid3d.data import build_training_data, micro_batches
from hybrid3d.data.builtin import builtin_tokenizer_path
from hybrid3d.parallel.tensor_parallel import IGNORE_INDEX
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.errors import ConfigError

TEMPLATE = Path(__file__).resolve().parents[2] / "ds_configs" / "chat_template.jinja"
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + {i}?"},
          {"role": "assistant", "content": f"It is {2 * i}."}, {"role": "user", "content": "Sure?"},
          {"role": "assistant", "content": "Yes."}] for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    tok.chat_template = TEMPLATE.read_text()
    return tok


def source(tokenizer, config_eos_id=None):
    def load():
        if tokenizer is None:
            raise AssertionError("pre-tokenized data must not load a tokenizer")
        return tokenizer

    return TokenizerSource(load=load, identity=f"test-{id(tokenizer)}", config_eos_id=config_eos_id)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def learned_text(data, tokenizer) -> str:
    tokens, learn = np.asarray(data.train.tokens), np.asarray(data.train.learn)
    return tokenizer.decode(tokens[learn == 1].tolist())


def test_chat_learns_the_assistant_turns_only(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    data = build_training_data(DataSection(path=path, format="chat", seq_length=128), source(tokenizer), 4096)
    eos = tokenizer.eos_token
    assert learned_text(data, tokenizer) == "".join(f"It is {2 * i}.{eos}\n\nYes.{eos}\n\n" for i in range(12))
    assert data.finetuning and "12 examples" in data.summary


def test_prompt_completion_learns_the_completion_and_eos(tmp_path, tokenizer):
    rows = [{"prompt": f"Q{i}: say {i}.", "completion": f" {i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    data = build_training_data(DataSection(path=path, format="prompt_completion", seq_length=32), source(tokenizer),
                               4096)
    assert learned_text(data, tokenizer) == "".join(f" {i}{tokenizer.eos_token}" for i in range(20))


def test_examples_are_packed_whole_and_targets_follow_the_masks(tmp_path):
    """Examples of 5, 7, 4, 9 tokens into 12-token spans: [5, 7] [4 + 8 padding] [9 + 3 padding] + 1."""
    lengths = [5, 7, 4, 9]
    rows, first = [], 10
    for n in lengths:
        ids = list(range(first, first + n))
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
        first += n
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ids"))
    data = build_training_data(DataSection(path=str(tmp_path / "ids"), seq_length=12), source(None, 0), 64)
    samples = data.train
    assert len(samples) == 3 and len(samples.tokens) == 37
    assert list(samples.tokens[:12]) == list(range(10, 22))
    assert list(samples.tokens[12:16]) == list(range(22, 26)) and list(samples.tokens[16:24]) == [0] * 8
    assert list(samples.tokens[24:33]) == list(range(26, 35))
    # learned: every example's tokens from its third on (labels), never padding
    assert list(samples.learn[:12]) == [0, 0, 1, 1, 1] + [0, 0, 1, 1, 1, 1, 1]
    assert list(samples.starts[:12]) == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert samples.targets(0, document_mask=False).tolist() == [-100, 12, 13, 14, -100, -100, 17, 18, 19, 20, 21,
                                                                -100]
    assert samples.positions(0).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert samples.positions(1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    # the global batch's loss weight: micro-batches / counted targets (3 + 5 + 2 + 7 over the three samples)
    batches = list(micro_batches(samples, 0, 3, 0, 1, 1, document_mask=True))
    assert [b.loss_weight.item() for b in batches] == pytest.approx([3 / 17] * 3)


def test_document_mask_does_not_count_a_document_start_as_a_target():
    from hybrid3d.data.packing import PackedSamples

    tokens = np.arange(9)
    starts = np.array([1, 0, 0, 1, 0, 0, 0, 1, 0], dtype=np.uint8)
    samples = PackedSamples(tokens, 8, starts=starts)
    assert samples.targets(0, document_mask=False).tolist() == list(range(1, 9))  # Megatron: across documents
    assert samples.targets(0, document_mask=True).tolist() == [1, 2, -100, 4, 5, 6, -100, 8]
    assert samples.positions(0).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_pretokenized_text_needs_no_tokenizer_and_takes_eos_from_the_model_config(tmp_path):
    datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8]}] * 10).save_to_disk(str(tmp_path / "ids"))
    data = build_training_data(DataSection(path=str(tmp_path / "ids"), seq_length=8), source(None, 3), 16)
    assert list(data.train.tokens[:10]) == [5, 6, 7, 8, 3, 5, 6, 7, 8, 3] and data.eos_id == 3


@pytest.mark.parametrize("rows, section, needle", [
    ([{"text": "hello"}], dict(format="chat"), "'chat' needs column 'messages'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(format="chat"),
     "row 0: the chat template yields no assistant tokens"),
    ([{"messages": "not a list"}], dict(format="chat"), "row 0: 'messages' must be a list"),
    ([{"prompt": "hi"}], dict(format="prompt_completion"), "needs column 'completion'"),
    ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], {}, "row 0: 'labels' has 2 entries for 3 input_ids"),
    ([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [1, 2, 3], "labels": [-100] * 3}], {},
     "row 1: every label is masked"),
    ([{"input_ids": [1, 2, 3], "labels": [1, 5, 3]}], {}, "row 0: 'labels' must equal input_ids or be -100"),
    ([{"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}], {}, "row 0: 'loss_mask' must hold 0 or 1"),
    ([{"input_ids": [1, 2, 300]}], {}, "holds token id 300, beyond the model's vocab_size 64"),
])
def test_bad_fine_tuning_data_is_refused_naming_the_row(tmp_path, tokenizer, rows, section, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        build_training_data(DataSection(path=path, seq_length=8, **section), source(tokenizer, 0), 64)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_tokenizer_without_chat_template_is_refused(tmp_path):
    plain = AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(ConfigError, match="hybrid3d.data.chat_template: the tokenizer has no chat template"):
        build_training_data(DataSection(path=path, format="chat", seq_length=64), source(plain), 4096)


def test_a_rank_reads_only_its_share_of_tokens_and_nothing_until_asked():
    """With a loss mask the loss's denominator counts the whole global batch: a DP rank reads the other shares'
    masks (1 byte a token), not their tokens; and a batch nobody asks for (a middle pipeline stage's) reads nothing."""
    from hybrid3d.data.packing import PackedSamples

    s, global_batch, dp = 4, 8, 4
    tokens = np.arange(global_batch * s + 1)
    learn = (np.arange(len(tokens)) % 3 != 0).astype(np.uint8)
    samples = PackedSamples(tokens, s, learn=learn, starts=np.zeros(len(tokens), dtype=np.uint8))
    read = []
    sample = samples.sample
    samples.sample = lambda index: read.append(index) or sample(index)
    batches = micro_batches(samples, 0, global_batch, dp_rank=1, dp=dp, micro_batch=1)
    assert read == []  # a generator: nothing read before the engine asks (DeepSpeed asks on the first and last stage)
    got = list(batches)
    assert sorted(set(read)) == [2, 3]  # this rank's share only (old code read all 8 samples' tokens)
    counted = int(learn[1:global_batch * s + 1].sum())  # every share's counted targets
    assert got[0].loss_weight.item() == pytest.approx((global_batch // 1) / counted)


def test_pretokenized_text_takes_the_tokenizers_eos_when_the_config_has_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID3D_CACHE", str(tmp_path / "cache"))
    datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8]}] * 10).save_to_disk(str(tmp_path / "ids"))
    section = DataSection(path=str(tmp_path / "ids"), seq_length=8)
    with_tokenizer = TokenizerSource(load=lambda: type("T", (), {"eos_token_id": 2})(), identity="t", config_eos_id=None)
    assert build_training_data(section, with_tokenizer, 16).eos_id == 2
    none = TokenizerSource(load=lambda: (_ for _ in ()).throw(ConfigError("no tokenizer")), identity="none",
                           config_eos_id=None)
    with pytest.raises(ConfigError) as error:
        build_training_data(section, none, 16)
    message = str(error.value)  # the key once, then what is missing
    assert message.startswith("hybrid3d.data.path: the data is pre-tokenized") and message.count("data.path") == 1
