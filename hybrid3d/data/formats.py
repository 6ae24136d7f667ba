"""From dataset rows to token ids and, for fine-tuning data, which tokens the loss learns.

`hybrid3d.data.format` names what a row holds:
- "text": a `text_field` column of raw text (pre-training; every token is learned);
- "chat": a `messages` column of {"role", "content"} turns, rendered with the tokenizer's chat template (or
  `hybrid3d.data.chat_template`); only the assistant turns are learned;
- "prompt_completion": `prompt` and `completion` columns; only the completion (and the EOS after it) is learned.
A dataset that already has `input_ids` is used as given, whatever the format: with a `labels` column (HF's
convention, -100 where no loss is taken) or a `loss_mask` column (1 = learned) it is fine-tuning data, without
either it is pre-training data. Nothing needs a tokenizer then.

Rows become {"input_ids": [...]} (pre-training: EOS-joined into one stream, Megatron's packing) or
{"input_ids": [...], "learn": [...]} (fine-tuning: each example kept whole in one window, `pipeline.py`).
`learn[j]` = 1 when token j is a target the loss counts, i.e. the model learns to predict it from tokens < j.
"""

from typing import Optional

from hybrid3d.errors import ConfigError
from hybrid3d.parallel.tensor_parallel.cross_entropy import IGNORE_INDEX  # HF's label for "no loss here"

KEY = "hybrid3d.data"


def is_finetuning(columns: list[str], data_format: str) -> bool:
    """Whether rows become separately packed examples with a loss mask (else one EOS-joined stream)."""
    if "input_ids" in columns:
        return "labels" in columns or "loss_mask" in columns
    return data_format != "text"


def needs_tokenizer(columns: list[str]) -> bool:
    return "input_ids" not in columns


def row_encoder(columns: list[str], data_format: str, text_field: str, tokenizer, eos_id: int, where: str):
    """`encode(row, index)` -> {"input_ids"[, "learn"]} for rows with these columns, checking each row; `where`
    names the data path (key or file) in errors."""
    if "input_ids" in columns:
        return _pretokenized(columns, where)
    if tokenizer is None:
        raise ConfigError(f"{KEY}.tokenizer: {where} holds text to tokenize but no tokenizer was found (set "
                          f"{KEY}.tokenizer to a tokenizer folder, or give pre-tokenized `input_ids`)")
    return {"text": _text, "chat": _chat, "prompt_completion": _prompt_completion}[data_format](
        columns, text_field, tokenizer, eos_id, where)


def encode_rows(documents, data_format: str, text_field: str, tokenizer, eos_id: int, where: str):
    """Map a `datasets.Dataset` to input_ids (+ learn), checking every row; `where` names the data path key."""
    columns = documents.column_names
    encode = row_encoder(columns, data_format, text_field, tokenizer, eos_id, where)
    return documents.map(encode, with_indices=True, remove_columns=columns, desc="tokenizing")


def _require(columns, names, what: str, where: str) -> None:
    missing = [n for n in names if n not in columns]
    if missing:
        raise ConfigError(f"{KEY}.format: {what} needs column{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(repr(m) for m in missing)} in {where} (columns: {', '.join(columns)})")


def _text(columns, text_field, tokenizer, eos_id, where):
    if text_field not in columns:
        raise ConfigError(f"{KEY}.text_field: column '{text_field}' is not in {where} (columns: {', '.join(columns)})")

    def encode(row, index):
        return {"input_ids": tokenizer(row[text_field], add_special_tokens=False)["input_ids"]}

    return encode


def _prompt_completion(columns, text_field, tokenizer, eos_id, where):
    _require(columns, ("prompt", "completion"), "'prompt_completion'", where)

    def encode(row, index):
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [eos_id]
        return {"input_ids": prompt + completion, "learn": [0] * len(prompt) + [1] * len(completion)}

    return encode


def _chat(columns, text_field, tokenizer, eos_id, where):
    _require(columns, ("messages",), "'chat'", where)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{KEY}.chat_template: the tokenizer has no chat template; set {KEY}.chat_template to a "
                          "Jinja template file (ds_configs/chat_template.jinja is one)")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{KEY}.tokenizer: format 'chat' needs a fast tokenizer (character offsets of tokens)")

    def encode(row, index):
        ids, learn = chat_tokens(row["messages"], tokenizer, f"{where} row {index}")
        return {"input_ids": ids, "learn": learn}

    return encode


def chat_tokens(messages, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and 1 for each token of an assistant turn.

    A turn's text is found by rendering the conversation up to it twice: up to the turn before with the
    generation prompt (the assistant header), and through the turn; the characters between the two are the
    assistant's reply and its end-of-turn marker, which the model must learn to emit. This works with any
    template whose renderings of shorter conversations are prefixes of longer ones (all common ones are);
    tokens are then marked by their character offsets, so no template needs `{% generation %}` tags."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ConfigError(f"{KEY}: {where}: 'messages' must be a list of {{\"role\", \"content\"}} objects")

    def render(turns, generation_prompt=False):
        if not turns:
            return ""
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[:i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(f"{KEY}.chat_template: {where}: the template does not render shorter conversations as "
                              "prefixes of longer ones, so the assistant turns cannot be located")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    learn = [int(any(start <= first < end for start, end in spans)) for first, _ in encoded["offset_mapping"]]
    if not any(learn):
        raise ConfigError(f"{KEY}: {where}: the chat template yields no assistant tokens (no assistant turn, or "
                          "its content renders empty)")
    return list(encoded["input_ids"]), learn


def _pretokenized(columns, where):
    label_column = [c for c in ("labels", "loss_mask") if c in columns]
    if len(label_column) > 1:
        raise ConfigError(f"{KEY}: {where} has both 'labels' and 'loss_mask' columns: keep one")
    column = label_column[0] if label_column else None

    def encode(row, index):
        ids = list(row["input_ids"])
        if column is None:
            return {"input_ids": ids}
        given = list(row[column])
        if len(given) != len(ids):
            raise ConfigError(f"{KEY}: {where} row {index}: '{column}' has {len(given)} entries for "
                              f"{len(ids)} input_ids")
        learn = _learn_from(column, given, ids, f"{where} row {index}")
        return {"input_ids": ids, "learn": learn}

    return encode


def _learn_from(column: str, given: list, ids: list, where: str) -> list[int]:
    if column == "loss_mask":
        if any(v not in (0, 1) for v in given):
            raise ConfigError(f"{KEY}: {where}: 'loss_mask' must hold 0 or 1")
        learn = [int(v) for v in given]
    else:  # HF labels: the token itself where it is learned (the model shifts them), -100 elsewhere
        if any(label != IGNORE_INDEX and label != token for label, token in zip(given, ids)):
            raise ConfigError(f"{KEY}: {where}: 'labels' must equal input_ids or be {IGNORE_INDEX} at every "
                              "position (HF's causal-LM convention)")
        learn = [int(label != IGNORE_INDEX) for label in given]
    if not any(learn[1:]):
        raise ConfigError(f"{KEY}: {where}: every label is masked (no token to learn)")
    return learn


def max_token_id(encoded) -> Optional[int]:
    """The largest id in an encoded dataset (None when empty)."""
    largest = None
    for batch in encoded.with_format("numpy").iter(batch_size=1024):  # a batch of rows at a time, not the column
        for ids in batch["input_ids"]:
            if len(ids):
                top = int(ids.max())
                largest = top if largest is None else max(largest, top)
    return largest
