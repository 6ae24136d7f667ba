"""data.blend: the sample-to-dataset order is megatron-core's `build_blending_indices` (the oracle), at any sample,
any DP size and after a resume; each dataset evaluates on its own; bad entries are one line naming the key."""

import json

import numpy as np
import pytest

import hybrid3d.data.blend as blend
from hybrid3d.config.sections import DataSection, parse_hybrid_section
from hybrid3d.data import DataCursor, build_training_data, micro_batches
from hybrid3d.data.baseline import baseline_entropy, entropy, unigram_counts
from hybrid3d.data.blend import BlendIndex, normalised
from hybrid3d.data.indexed import IndexedWriter
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.errors import ConfigError
from hybrid3d.training.metrics import MetricsLogger
from tests.megatron_oracle import megatron_datasets

WEIGHTS = [[0.3, 0.7], [1, 1, 1], [5, 0, 3], [0, 1, 1], [0.011, 0.5, 0.2, 0.289], [0.02, 0.98], [2.5]]


def megatron_order(weights, n):
    datasets, samples = np.zeros(n, np.int16), np.zeros(n, np.int64)
    megatron_datasets().helpers.build_blending_indices(datasets, samples, normalised(weights), len(weights), n, False)
    return datasets, samples


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_the_order_is_megatron_cores_at_any_sample(weights):
    n = 60_000
    datasets, samples = megatron_order(weights, n)
    for size in (1, 2, 3, 1000, n):
        assert BlendIndex(weights).taken_at(size).tolist() == np.bincount(datasets[:size], minlength=len(weights)) \
            .tolist()
    index = BlendIndex(weights)
    for first, count in ((0, 500), (500, 700), (31_000, 300), (n - 300, 300), (10, 5)):  # forward, then back
        got = index.steps(first, count)
        assert got[0].tolist() == datasets[first:first + count].tolist()
        assert got[1].tolist() == samples[first:first + count].tolist()


def test_wrong_guesses_cost_time_not_exactness(monkeypatch):
    """Every stretch starts from a wrong state: each fails its check and is redone from the previous one's end."""
    weights = [0.2, 0.3, 0.5]
    datasets, _ = megatron_order(weights, 50_000)
    monkeypatch.setattr(blend, "_guess", lambda w, start: np.zeros((len(start), len(w)), np.int64))
    assert BlendIndex(weights).taken_at(50_000).tolist() == np.bincount(datasets, minlength=3).tolist()


EOS, VOCAB, S = 1, 300, 8


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID3D_CACHE", str(tmp_path / "cache"))


def ids_source() -> TokenizerSource:
    def load():
        raise ConfigError("no tokenizer")

    return TokenizerSource(load=load, identity="none", config_eos_id=EOS)


def docs(seed, count=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, int(rng.integers(3, 20))).tolist() for _ in range(count)]


def indexed(tmp_path, name, documents, dtype=np.uint16) -> str:
    prefix = str(tmp_path / name)
    with IndexedWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc + [EOS])
    return prefix


def rows(tmp_path, name, documents) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in documents))
    return str(path)


@pytest.fixture()
def two(tmp_path):
    """A Megatron indexed dataset (weight 3) and a jsonl of input_ids rows (weight 1), 10% of each held out."""
    entries = [{"path": indexed(tmp_path, "web", docs(0)), "weight": 3},
               {"path": rows(tmp_path, "code", docs(1, 15)), "weight": 1}]
    section = DataSection(blend=entries, seq_length=S, eval_fraction=0.1)
    return build_training_data(section, ids_source(), VOCAB)


def ids_of(samples, first, batch, dp):
    return [row for r in range(dp) for b in micro_batches(samples, first, batch, r, dp, 2) for row in b.ids.tolist()]


def test_sample_i_is_the_next_sample_of_the_dataset_megatron_names(two):
    blended = two.train
    datasets, samples = megatron_order([3, 1], 200)
    web, code = (p.samples for p in blended.parts)
    assert code.sample(len(code)).tolist() == code.sample(0).tolist()  # each dataset wraps at its own end
    expected = [(web, code)[k].sample(j)[:-1].tolist() for k, j in zip(datasets, samples)]
    assert [blended.sample(i)[:-1].tolist() for i in range(200)] == expected
    # the same at any DP size, and resumed by samples consumed at another global batch
    assert ids_of(blended, 0, 16, 1) == ids_of(blended, 0, 16, 2) == ids_of(blended, 0, 16, 4) == expected[:16]
    cursor = DataCursor()
    seen = [row for _ in range(3) for row in ids_of(blended, cursor.next_batch(16), 16, 2)]
    resumed = DataCursor(cursor.samples_consumed)
    seen += [row for _ in range(2) for row in ids_of(blended, resumed.next_batch(8), 8, 4)]
    assert seen == expected[:64]


def test_each_dataset_holds_out_and_reports_its_own(two):
    assert two.eval is None and sorted(two.evals) == ["code", "web"]
    assert two.summary == "a blend of 2 datasets"
    web, code = two.train.parts
    assert web.account == "36 documents, " + web.account.split(", ")[1]
    lines = two.train.lines(1000)
    taken = np.bincount(megatron_order([3, 1], 1000)[0], minlength=2)
    assert lines[0] == (f"  web: {web.account}; weight 0.750; {taken[0] / len(web.samples):.2f} epochs in the run's "
                        "1,000 samples")
    assert lines[1].startswith(f"  code: {code.account}; weight 0.250; ")


def test_the_baseline_of_a_blend_mixes_the_datasets_frequencies(two):
    web, code = (p.samples for p in two.train.parts)
    p = [unigram_counts(s.tokens) / len(s.tokens) for s in (web, code)]
    size = max(len(q) for q in p)
    mixture = sum(w * np.pad(q, (0, size - len(q))) for w, q in zip((0.75, 0.25), p))
    value, what = baseline_entropy(two.train)
    assert value == pytest.approx(entropy(mixture)) and what.startswith("blend's training tokens")


def test_an_entry_eval_path_and_the_console_line(tmp_path, capsys):
    web = indexed(tmp_path, "web", docs(0))
    entries = [{"path": web, "weight": 1, "eval_path": rows(tmp_path, "held", docs(5))},
               {"path": rows(tmp_path, "code", docs(1)), "weight": 1}]
    data = build_training_data(DataSection(blend=entries, seq_length=S), ids_source(), VOCAB)
    assert list(data.evals) == ["web"] and len(data.evals["web"]) > 0
    logger = MetricsLogger(str(tmp_path), 10, 64, 1, 1.0, None, enabled=True)
    record = logger.record(1, 2.0, 1e-3, 1.0, 0.5, eval_loss=2.5, eval_losses={"web": 2.25, "code": 2.75})
    assert record["eval_losses"] == {"web": 2.25, "code": 2.75}
    assert "eval loss 2.5000 (ppl 12.2, web 2.2500, code 2.7500)" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["eval_losses"]["code"] == 2.75


@pytest.mark.parametrize("blend_value, says", [
    ([{"path": "a", "weight": -1}], "hybrid3d.data.blend[0].weight must be a number >= 0, got -1"),
    ([{"path": "a", "weight": 0}, {"path": "b", "weight": 0}], "hybrid3d.data.blend: every weight is 0"),
    ([{"path": "a", "weight": 1}, {}], "hybrid3d.data.blend[1] must be an object with a path and a weight"),
    ([{"path": "a"}], "hybrid3d.data.blend[0].weight is missing"),
    ([{"path": "", "weight": 1}], "hybrid3d.data.blend[0].path must be a non-empty string"),
    ([{"path": "a", "weight": 1, "wieght": 2}], "hybrid3d.data.blend[0].wieght is not a known key"),
    ([], "hybrid3d.data.blend must be a non-empty list"),
    ([{"path": "a", "weight": True}], "hybrid3d.data.blend[0].weight must be a number >= 0"),
])
def test_bad_entries_are_one_line_naming_the_key(blend_value, says):
    with pytest.raises(ConfigError) as error:
        parse_hybrid_section({"hybrid3d": {"data": {"blend": blend_value}}})
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_blend_and_a_path_are_exclusive():
    with pytest.raises(ConfigError, match=r"hybrid3d\.data\.blend and hybrid3d\.data\.path are exclusive"):
        parse_hybrid_section({"hybrid3d": {"data": {"path": "x", "blend": [{"path": "a", "weight": 1}]}}})


def test_indexed_datasets_of_other_token_types_are_not_blended(tmp_path):
    entries = [{"path": indexed(tmp_path, "a", docs(0)), "weight": 1},
               {"path": indexed(tmp_path, "b", docs(1), np.int32), "weight": 1}]
    with pytest.raises(ConfigError, match=r"hybrid3d\.data\.blend\[1\]\.path: .*b stores int32 token ids and .*a "
                                          r"\(blend\[0\]\) uint16"):
        build_training_data(DataSection(blend=entries, seq_length=S), ids_source(), VOCAB)
