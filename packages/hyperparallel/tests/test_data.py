"""The data pipeline: tokenizer, generated corpus, file loading, packing, resumable sharding."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperparallel.data import (
    ByteTokenizer,
    PackedBlocks,
    ShardedSampler,
    batch,
    default_corpus,
    default_corpus_info,
    load_documents,
)

TOK = ByteTokenizer()
BOS, EOS = TOK.bos_id, TOK.eos_id


# --- tokenizer ---------------------------------------------------------------------------------


def test_special_ids_are_distinct_and_above_the_bytes() -> None:
    specials = {TOK.bos_id, TOK.eos_id, TOK.pad_id}
    assert len(specials) == 3
    assert all(255 < s < TOK.vocab_size for s in specials)
    assert TOK.vocab_size == 259


@given(st.text())
def test_round_trip_of_any_text(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text


def test_non_ascii_is_several_byte_tokens() -> None:
    text = "naïve 中文 🦀"
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert TOK.decode(ids) == text


def test_decode_skips_specials_and_replaces_broken_utf8() -> None:
    ids = [BOS, *TOK.encode("hé"), EOS, TOK.pad_id]
    assert TOK.decode(ids) == "hé"
    assert TOK.decode(TOK.encode("é")[:1]) == "\ufffd"
    assert TOK.decode(torch.tensor([BOS, 104, 105])) == "hi"


@pytest.mark.parametrize("bad", [-1, 259, 1000])
def test_decode_rejects_ids_outside_the_vocabulary(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token id {bad} is outside .*0\.\.258"):
        TOK.decode([104, bad])


# --- default corpus ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return default_corpus()


def test_corpus_is_deterministic_and_seeded() -> None:
    assert default_corpus(300, seed=5) == default_corpus(300, seed=5)
    assert default_corpus(300, seed=5) != default_corpus(300, seed=6)
    assert default_corpus(100, seed=5) == default_corpus(300, seed=5)[:100]


def test_corpus_size(corpus: list[str]) -> None:
    size = sum(len(doc.encode("utf-8")) for doc in corpus)
    assert len(corpus) == 4000
    assert all(doc.strip() for doc in corpus)
    assert 200_000 < size < 1_000_000


def test_corpus_info_describes_the_default(corpus: list[str]) -> None:
    info = default_corpus_info()
    size_kb = sum(len(doc.encode("utf-8")) for doc in corpus) / 1000
    assert "\n" not in info
    assert "4000 documents" in info
    reported = float(re.search(r"(\d+) kB", info).group(1))
    assert abs(reported - size_kb) <= 0.5


def test_corpus_rejects_zero_documents() -> None:
    with pytest.raises(ValueError, match="num_docs must be at least 1, got 0"):
        default_corpus(0)


def _lines(corpus: list[str]) -> list[str]:
    return [line for doc in corpus for line in doc.split("\n")]


def test_every_kind_of_document_is_present(corpus: list[str]) -> None:
    firsts = [doc.split("\n")[0] for doc in corpus]
    kinds = {
        "arithmetic": sum(bool(re.fullmatch(r"\d+ [-+*] \d+ = \d+", f)) for f in firsts),
        "records": sum(f.startswith("id: ") for f in firsts),
        "counting": sum(f.startswith("count by ") for f in firsts),
        "story": sum(f[0].isupper() and f.endswith(".") for f in firsts),
    }
    assert sum(kinds.values()) == len(corpus)
    assert all(n > len(corpus) // 8 for n in kinds.values()), kinds


def test_arithmetic_facts_are_correct(corpus: list[str]) -> None:
    facts = [
        m for line in _lines(corpus) if (m := re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", line))
    ]
    assert len(facts) > 1000
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for m in facts:
        assert ops[m[2]](int(m[1]), int(m[3])) == int(m[4]), m[0]


def test_counting_lines_are_arithmetic_progressions(corpus: list[str]) -> None:
    lines = [line for line in _lines(corpus) if line.startswith("count by ")]
    assert len(lines) > 1000
    for line in lines:
        step, start, terms = re.fullmatch(r"count by (\d+) from (\d+): ([\d ]+)", line).groups()
        values = [int(t) for t in terms.split()]
        assert values[0] == int(start)
        assert all(b - a == int(step) for a, b in itertools.pairwise(values)), line


def test_records_count_up_and_each_name_keeps_its_town(corpus: list[str]) -> None:
    town_of: dict[str, str] = {}
    for doc in corpus:
        if not doc.startswith("id: "):
            continue
        rows = [dict(f.split(": ") for f in line.split("; ")) for line in doc.split("\n")]
        ids = [int(r["id"]) for r in rows]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        for r in rows:
            assert town_of.setdefault(r["name"], r["town"]) == r["town"], r
    assert len(town_of) > 5


def test_story_sentences_agree_in_number_and_article(corpus: list[str]) -> None:
    sentences = [line for line in _lines(corpus) if line.endswith(".") and line[0].isupper()]
    assert len(sentences) > 1000
    verbs = {"sees": 1, "likes": 1, "chases": 1, "follows": 1, "helps": 1, "watches": 1}
    verbs |= {"see": 2, "like": 2, "chase": 2, "follow": 2, "help": 2, "watch": 2}
    singular = {"a", "an", "cat", "dog", "owl", "fox", "mouse", "goat", "eagle"}
    plural = {
        "two",
        "three",
        "some",
        "many",
        "cats",
        "dogs",
        "owls",
        "foxes",
        "mice",
        "goats",
        "eagles",
    }
    checked = 0
    for sentence in sentences:
        words = sentence.rstrip(".").lower().split()
        verb_at = next(i for i, w in enumerate(words) if w in verbs)
        subject = set(words[:verb_at])
        if subject & singular or subject & plural:  # only "the sheep" leaves the number open
            expected = 1 if subject & singular else 2
            assert not subject & (plural if expected == 1 else singular), sentence
            assert verbs[words[verb_at]] == expected, sentence
            checked += 1
        for article, noun in itertools.pairwise(words):
            if article in {"a", "an"}:
                assert (article == "an") == (noun[0] in "aeiou"), sentence
    assert checked > 0.9 * len(sentences)


def _stream(docs: list[str]) -> np.ndarray:
    return np.array([t for doc in docs for t in (BOS, *TOK.encode(doc), EOS)], dtype=np.int64)


def _trigram_cross_entropy(train: np.ndarray, test: np.ndarray, k: float = 0.01) -> float:
    """Nats per token on ``test`` of an add-``k`` smoothed trigram model counted on ``train``."""
    v = TOK.vocab_size

    def codes(a: np.ndarray) -> np.ndarray:
        return (a[:-2] * v + a[1:-1]) * v + a[2:]

    def counts(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
        unique, n = np.unique(keys, return_counts=True)
        at = np.minimum(np.searchsorted(unique, queries), len(unique) - 1)
        return np.where(unique[at] == queries, n[at], 0)

    train_codes, test_codes = codes(train), codes(test)
    joint = counts(train_codes, test_codes)
    context = counts(train_codes // v, test_codes // v)
    return float(-np.log((joint + k) / (context + k * v)).mean())


def test_corpus_is_learnable_by_a_trigram_model(corpus: list[str]) -> None:
    cut = len(corpus) * 9 // 10
    train, held_out = _stream(corpus[:cut]), _stream(corpus[cut:])
    uniform = math.log(TOK.vocab_size)
    learned = _trigram_cross_entropy(train, held_out)
    assert learned < 1.5 < 0.3 * uniform, learned
    # Control: the same bytes in random order leave a trigram model little to learn.
    rng = np.random.default_rng(0)
    shuffled = _trigram_cross_entropy(rng.permutation(train), rng.permutation(held_out))
    assert shuffled > 2 * learned, (shuffled, learned)


# --- load_documents ----------------------------------------------------------------------------


def test_txt_files_are_whole_documents_in_sorted_order(tmp_path) -> None:
    (tmp_path / "b.txt").write_text("second\nfile\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first ü", encoding="utf-8")
    (tmp_path / "c.txt").write_text("  \n", encoding="utf-8")
    assert load_documents(str(tmp_path / "*.txt")) == ["first ü", "second\nfile\n"]


def test_jsonl_lines_are_documents(tmp_path) -> None:
    lines = [
        json.dumps({"text": "one", "id": 1}),
        "",
        json.dumps({"text": ""}),
        json.dumps({"text": "two\nlines"}),
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_documents(str(tmp_path / "d.jsonl")) == ["one", "two\nlines"]


def test_jsonl_splits_only_at_newlines(tmp_path) -> None:
    records = [{"text": "line\u2028separator\r\nand crlf"}, {"text": "next"}]
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    (tmp_path / "d.jsonl").write_text(text, encoding="utf-8", newline="")
    assert load_documents(str(tmp_path / "d.jsonl")) == [r["text"] for r in records]


def test_jsonl_with_another_text_key(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n', encoding="utf-8")
    assert load_documents([str(tmp_path / "d.jsonl")], text_key="body") == ["x", "y"]


def test_patterns_keep_their_order_and_a_file_is_read_once(tmp_path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "z.jsonl").write_text('{"text": "z"}\n', encoding="utf-8")
    patterns = [str(tmp_path / "b.txt"), str(tmp_path / "*.txt"), str(tmp_path / "**/*.jsonl")]
    assert load_documents(patterns) == ["b.txt", "a.txt", "z"]


def test_home_is_expanded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "doc.txt").write_text("home", encoding="utf-8")
    assert load_documents("~/doc.txt") == ["home"]


def test_a_pattern_without_files_names_the_pattern(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("a", encoding="utf-8")
    missing = str(tmp_path / "nope*.txt")
    with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
        load_documents([str(tmp_path / "a.txt"), missing])


def test_unsupported_suffix_names_the_file_and_the_supported_ones(tmp_path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}: unsupported file type '.csv'")) as e:
        load_documents(str(path))
    assert ".txt, .jsonl" in str(e.value)


def test_a_directory_asks_for_a_glob(tmp_path) -> None:
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(ValueError, match="is a directory; pass a glob"):
        load_documents(str(tmp_path / "dir.txt"))


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"title": "x"}', "no 'text' field; set data.text_key to the field holding the text"),
        ('["text"]', "a JSON list, not an object; each line must be one object with a 'text'"),
        ('"text"', "a JSON str, not an object"),
        ('{"text": 3}', "field 'text' is int, expected a string"),
        # valid JSON, but no UTF-8 text: the tokenizer's error named neither file nor line
        ('{"text": "ab\\ud800"}', "field 'text' holds '\\ud800' at character 2, a lone surrogate"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, bad_line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(f'{{"text": "ok"}}\n\n{bad_line}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: {message}")):
        load_documents(str(path))


def test_invalid_utf8_names_the_file(tmp_path) -> None:
    path = tmp_path / "bin.txt"
    path.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid UTF-8")):
        load_documents(str(path))


# --- packing -----------------------------------------------------------------------------------


def test_packing_places_bos_eos_and_drops_the_remainder() -> None:
    blocks = PackedBlocks(["ab", "cde"], TOK, seq_len=3)
    a, b, c, d, e = (ord(ch) for ch in "abcde")
    assert blocks.num_tokens == 9
    assert len(blocks) == 2
    assert blocks[0].tolist() == [BOS, a, b, EOS]
    assert blocks[1].tolist() == [BOS, c, d, e]  # the final EOS is the dropped remainder
    assert blocks[1].dtype == torch.int64
    assert blocks[-1].tolist() == blocks[1].tolist()
    with pytest.raises(IndexError):
        blocks[2]


@given(
    st.lists(st.text(max_size=40), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=16),
)
def test_blocks_tile_a_prefix_of_the_token_stream(docs: list[str], seq_len: int) -> None:
    stream = [t for doc in docs for t in (BOS, *TOK.encode(doc), EOS)]
    if len(stream) < seq_len + 1:
        with pytest.raises(ValueError, match=f"hold {len(stream)} tokens"):
            PackedBlocks(docs, TOK, seq_len)
        return
    blocks = PackedBlocks(docs, TOK, seq_len)
    assert len(blocks) == len(stream) // (seq_len + 1)
    joined = [t for i in range(len(blocks)) for t in blocks[i].tolist()]
    assert joined == stream[: len(joined)]
    assert len(stream) - len(joined) <= seq_len


def test_batch_shifts_labels_by_one() -> None:
    blocks = PackedBlocks(default_corpus(20), TOK, seq_len=16)
    inputs, labels = batch(blocks, [3, 0, 3])
    assert inputs.shape == labels.shape == (3, 16)
    assert inputs.dtype == labels.dtype == torch.int64
    for row, index in enumerate([3, 0, 3]):
        assert inputs[row].tolist() == blocks[index][:-1].tolist()
        assert labels[row].tolist() == blocks[index][1:].tolist()
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_batch_needs_indices() -> None:
    blocks = PackedBlocks(["abcdef"], TOK, seq_len=2)
    with pytest.raises(ValueError, match="at least one block index"):
        batch(blocks, [])


def test_too_little_data_says_how_much_is_there_and_needed() -> None:
    with pytest.raises(ValueError, match=r"hold 6 tokens.*seq_len=8 on 1 .*at least 9"):
        PackedBlocks(["abcd"], TOK, seq_len=8)
    # One block exists, but two data-parallel ranks need one each.
    assert len(PackedBlocks(["abcdefg"], TOK, seq_len=8)) == 1
    with pytest.raises(ValueError, match=r"hold 9 tokens.*on 2 data-parallel.*at least 18"):
        PackedBlocks(["abcdefg"], TOK, seq_len=8, world=2)


@pytest.mark.parametrize(("seq_len", "world"), [(0, 1), (4, 0)])
def test_packing_rejects_bad_sizes(seq_len: int, world: int) -> None:
    with pytest.raises(ValueError, match="must be at least 1"):
        PackedBlocks(["abcdef"], TOK, seq_len=seq_len, world=world)


# --- sampler -----------------------------------------------------------------------------------

layouts = st.integers(1, 4).flatmap(
    lambda world: st.integers(1, 5).flatmap(
        lambda batch_size: st.tuples(
            st.just(world),
            st.just(batch_size),
            st.integers(world * batch_size, world * batch_size * 4 + 7),
            st.integers(0, 2**31),
        )
    )
)


def _samplers(num_blocks: int, batch_size: int, world: int, seed: int) -> list[ShardedSampler]:
    return [ShardedSampler(num_blocks, batch_size, r, world, seed) for r in range(world)]


@given(layouts)
def test_each_epoch_shards_are_disjoint_and_cover_whole_steps(layout) -> None:
    world, batch_size, num_blocks, seed = layout
    samplers = _samplers(num_blocks, batch_size, world, seed)
    steps = num_blocks // (world * batch_size)
    shares = [[i for _ in range(steps) for i in s.next_indices()] for s in samplers]
    taken = [i for share in shares for i in share]
    assert len(taken) == len(set(taken)) == steps * world * batch_size
    assert num_blocks - len(taken) < world * batch_size
    assert set(taken) <= set(range(num_blocks))
    assert all(s.epoch == 1 and s.position == 0 for s in samplers)


def test_order_is_deterministic_and_depends_on_the_seed() -> None:
    def run(seed: int) -> list[list[int]]:
        sampler = ShardedSampler(64, 4, 1, 2, seed)
        return [sampler.next_indices() for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_epochs_roll_over_with_seed_plus_epoch() -> None:
    sampler = ShardedSampler(50, 4, 0, 3, seed=10)
    assert sampler.steps_per_epoch == 4
    first = [sampler.next_indices() for _ in range(4)]
    assert (sampler.epoch, sampler.position) == (1, 0)
    second = [sampler.next_indices() for _ in range(4)]
    assert (sampler.epoch, sampler.position) == (2, 0)
    assert first != second
    # Epoch e of seed s is epoch 0 of seed s + e.
    fresh = ShardedSampler(50, 4, 0, 3, seed=11)
    assert second == [fresh.next_indices() for _ in range(4)]


def test_a_step_is_one_global_batch_split_across_ranks() -> None:
    whole = ShardedSampler(40, 8, 0, 1, seed=3)
    split = _samplers(40, 2, 4, seed=3)
    for _ in range(12):
        assert whole.next_indices() == [i for s in split for i in s.next_indices()]


@settings(max_examples=60)
@given(layouts, st.data())
def test_resuming_continues_the_exact_sequence(layout, data) -> None:
    world, batch_size, num_blocks, seed = layout
    rank = data.draw(st.integers(0, world - 1))
    taken = data.draw(st.integers(0, 3 * (num_blocks // (world * batch_size)) + 2))
    original = ShardedSampler(num_blocks, batch_size, rank, world, seed)
    for _ in range(taken):
        original.next_indices()
    state = json.loads(json.dumps(original.state_dict()))
    resumed = ShardedSampler(num_blocks, batch_size, rank, world, seed=seed + 1)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (original.epoch, original.position)
    for _ in range(num_blocks // (world * batch_size) + 3):
        assert resumed.next_indices() == original.next_indices()


def test_state_dict_holds_progress_and_layout() -> None:
    sampler = ShardedSampler(30, 2, 1, 3, seed=4, fingerprint="abc")
    for _ in range(7):
        sampler.next_indices()
    assert sampler.state_dict() == {
        "epoch": 1,
        "position": 2,
        "seed": 4,
        "world": 3,
        "batch_size": 2,
        "num_blocks": 30,
        "documents": "abc",
    }


def test_resuming_on_other_blocks_of_the_same_count_is_refused() -> None:
    tokenizer = ByteTokenizer()
    cat = PackedBlocks(["the cat sat on the mat. " * 20], tokenizer, seq_len=16)
    dog = PackedBlocks(["the dog sat on the log. " * 20], tokenizer, seq_len=16)
    assert len(cat) == len(dog)
    assert cat.fingerprint != dog.fingerprint
    again = PackedBlocks(["the cat sat on the mat. " * 20], tokenizer, seq_len=16)
    assert again.fingerprint == cat.fingerprint
    saved = ShardedSampler(len(cat), 2, 0, 1, seed=0, fingerprint=cat.fingerprint)
    saved.next_indices()
    ShardedSampler(len(cat), 2, 0, 1, seed=0, fingerprint=again.fingerprint).load_state_dict(
        saved.state_dict()
    )
    with pytest.raises(ValueError, match="saved from other documents"):
        ShardedSampler(len(dog), 2, 0, 1, seed=0, fingerprint=dog.fingerprint).load_state_dict(
            saved.state_dict()
        )
    older = {k: v for k, v in saved.state_dict().items() if k != "documents"}  # before the key
    ShardedSampler(len(dog), 2, 0, 1, seed=0, fingerprint=dog.fingerprint).load_state_dict(older)


@pytest.mark.parametrize(("key", "other"), [("world", 4), ("batch_size", 3), ("num_blocks", 99)])
def test_resuming_with_another_layout_is_refused(key: str, other: int) -> None:
    saved = ShardedSampler(60, 2, 0, 2, seed=0)
    saved.next_indices()
    state = {**saved.state_dict(), key: other}
    with pytest.raises(ValueError, match=rf"saved with {key}={other} but this run has {key}=\d+"):
        ShardedSampler(60, 2, 0, 2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="same data and data-parallel layout"):
        ShardedSampler(60, 2, 0, 2, seed=0).load_state_dict(state)


def test_incomplete_or_out_of_range_state_is_refused() -> None:
    sampler = ShardedSampler(60, 2, 0, 2, seed=0)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="lacks epoch, position"):
        sampler.load_state_dict({k: v for k, v in state.items() if k not in {"epoch", "position"}})
    with pytest.raises(ValueError, match=r"position=15; expected .* position in 0\.\.14"):
        sampler.load_state_dict({**state, "position": 15})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 0, 1), "batch_size must be at least 1"),
        ((10, 2, 2, 2), "rank must be in 0..world-1"),
        ((10, 2, 0, 0), "rank must be in 0..world-1"),
        ((7, 2, 0, 4), r"7 blocks cannot fill one step of world=4 x batch_size=2 = 8 blocks"),
    ],
)
def test_sampler_rejects_impossible_layouts(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedSampler(*args, seed=0)
