"""The data stage: manifest validation, readers on fixture files in the real layouts, templates, the
contamination check, near-duplicates and `specdraft prompts` end to end (tiny tokenizer, no network)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from specdraft.data.manifest import (
    ManifestError,
    default_manifest_dict,
    load_manifest,
    parse_manifest_dict,
    templates_asset,
)
from specdraft.data.readers import (
    DataSourceError,
    MalformedRecord,
    get_reader,
    get_response_reader,
    iter_file_records,
    load_hub_records,
    read_eval_prompts,
)
from specdraft.data.templates import TemplateError, expand_templates, load_templates
from specdraft.data.text import contamination_filter, near_duplicates, ngram_overlap, normalise_prompt
from specdraft.stages.prompts import PromptsConfig, build_prompts

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "data"
CONFIGS = ROOT / "configs"
SHARED = ROOT.parent / "shared"
SHA_A = "0" * 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prompts_of(name: str, fmt: str, reader: str, fields: dict | None = None) -> list:
    """(location, prompt | None | MalformedRecord) for every record of a fixture file."""
    read = get_reader(reader, fields)
    out = []
    for rec in iter_file_records(FIX / name, fmt):
        if rec.error:
            out.append((rec.location, "ERROR"))
            continue
        try:
            out.append((rec.location, read(rec.data)))
        except MalformedRecord as e:
            out.append((rec.location, e))
    return out


def texts(results: list) -> list:
    return [r for _, r in results if isinstance(r, str) and r != "ERROR"]


def local_corpus(**kw) -> dict:
    c = {"name": "c", "kind": "local_file", "path": str(FIX / "gsm8k_train.jsonl"),
         "sha256": sha(FIX / "gsm8k_train.jsonl"), "format": "jsonl", "reader": "question", "license": "MIT"}
    c.update(kw)
    return c


def hub_corpus(**kw) -> dict:
    c = {"name": "hub", "kind": "hf_dataset", "repo_id": "ORG/data", "revision": COMMIT, "split": "train",
         "reader": "chat", "license": "MIT"}
    c.update(kw)
    return c


def manifest(*corpora: dict, **top) -> dict:
    m = {"schema_version": 1, "name": "t", "uses_eval_splits": False, "eval_examples_used_as_targets": False,
         "notes": "", "corpora": list(corpora)}
    m.update(top)
    return m


# ------------------------------------------------------------------------------------------------ readers

def test_chat_reader_ultrachat_parquet_skips_leading_system_and_assistant_turns():
    got = prompts_of("ultrachat_train_sft.parquet", "parquet", "chat")
    assert [loc.rsplit(":", 1)[1] for loc, _ in got] == ["row 0", "row 1", "row 2", "row 3"]
    assert got[0][1] == "How do bees decide where to build a new hive?"  # first user turn, not the second
    assert got[1][1] == "Plan a three-day walking trip in the Lake District."  # system + assistant skipped
    assert got[2][1] is None  # only an assistant turn: no prompt
    assert got[3][1].strip().startswith("Give me a packing list")


def test_chat_reader_ultrachat_jsonl_reports_the_bad_line():
    got = prompts_of("ultrachat_train_sft.jsonl", "jsonl", "chat")
    assert len(got) == 5
    assert got[2] == (f"{FIX / 'ultrachat_train_sft.jsonl'}:3", "ERROR")
    assert got[1][1] == "Plan a three-day walking trip in the Lake District."


def test_chat_reader_sharegpt_conversations():
    got = prompts_of("sharegpt.jsonl", "jsonl", "chat")
    assert got[0][1] == "What is a good name for a bakery that sells only sourdough?"
    assert got[1][1] == "Now rewrite the poem so that every line rhymes with moon."  # leading gpt turn skipped
    assert got[2][1] == "List three uses for baking soda around the house."  # leading system turn skipped
    assert got[3][1] is None  # gpt only
    assert got[4] == (f"{FIX / 'sharegpt.jsonl'}:5", "ERROR")  # invalid JSON line
    assert isinstance(got[5][1], MalformedRecord) and "conversations" in str(got[5][1])
    assert got[6][1].strip() == ""


def test_chat_reader_prompt_only_file():
    assert texts(prompts_of("prompts_only.jsonl", "jsonl", "chat"))[2] == \
        "What are three ways to keep basil alive on a windowsill?"


def test_chat_reader_field_mapping():
    rec = {"dialog": [{"speaker": "bot", "text": "hi"}, {"speaker": "Human", "text": "mapped question"}]}
    read = get_reader("chat", {"messages": "dialog", "role": "speaker", "content": "text"})
    assert read(rec) == "mapped question"
    with pytest.raises(MalformedRecord):
        get_reader("chat")(rec)


def test_oss_instruct_reader_magicoder_layout():
    got = prompts_of("magicoder_oss_instruct.jsonl", "jsonl", "oss_instruct")
    assert got[0][1].startswith("You are given a function that computes the area of a circle")
    assert "parse_pairs" in got[1][1]
    assert isinstance(got[2][1], MalformedRecord) and "problem" in str(got[2][1])


def test_alpaca_reader_json_array_with_line_numbers():
    got = prompts_of("alpaca.json", "json", "alpaca")
    lines = (FIX / "alpaca.json").read_text().splitlines()
    for loc, _ in got:  # each location points at the line where the record starts
        lineno = int(loc.rsplit(":", 1)[1])
        assert lines[lineno - 1].strip() in ("{", "[")
    assert got[0][1] == "Give three tips for staying focused while studying."  # empty input: no blank line
    assert got[1][1] == ("Classify the sentiment of this review.\n\n"
                         "The soup was cold and the waiter ignored us.")
    assert isinstance(got[3][1], MalformedRecord)  # a list, not an object
    assert isinstance(got[4][1], MalformedRecord) and "instruction" in str(got[4][1])


def test_alpaca_reader_instruction_only_jsonl():
    assert texts(prompts_of("instructionwild.jsonl", "jsonl", "alpaca"))[0] == "Tell me a joke about compilers."


def test_question_reader_gsm8k_never_reads_the_answer():
    got = texts(prompts_of("gsm8k_train.jsonl", "jsonl", "question"))
    assert len(got) == 3 and got[2].startswith("Lena buys 4 notebooks")
    assert not any("####" in t for t in got)


def test_response_readers_take_the_answer_to_the_first_user_turn():
    chat = get_response_reader("chat")
    turns = [{"from": "gpt", "value": "earlier answer"}, {"from": "human", "value": "q"},
             {"from": "gpt", "value": "the answer"}, {"from": "human", "value": "q2"}]
    assert chat({"conversations": turns}) == "the answer"  # not the leading gpt turn
    assert chat({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"},
                              {"role": "assistant", "content": "late"}]}) is None  # not an answer to q
    assert chat({"messages": [{"role": "user", "content": "q"}]}) is None
    assert chat({"conversations": "not a list"}) is None  # odd records: no answer, never an error
    assert get_response_reader("alpaca")({"instruction": "i", "output": "o"}) == "o"
    assert get_response_reader("alpaca")({"instruction": "i", "response": "r"}) == "r"  # GPTeacher
    assert get_response_reader("alpaca")({"instruction": "i", "output": "  "}) is None
    assert get_response_reader("question")({"question": "q", "answer": "4*3+2=14 #### 14"}).endswith("14")
    assert get_response_reader("oss_instruct")({"problem": "p", "solution": "def f(): ..."}) == "def f(): ..."
    assert get_response_reader("turns")({"turns": ["a"]}) is None
    assert get_response_reader("alpaca", {"output": "answer"})({"instruction": "i", "answer": "mapped"}) == "mapped"


def test_turns_reader_mt_bench_takes_the_first_turn():
    got = texts(prompts_of("mt_bench.jsonl", "jsonl", "turns"))
    assert got[2] == "A triangle has corners at (0, 0), (4, 0) and (0, 3). What is its area?"
    with pytest.raises(MalformedRecord):
        get_reader("turns")({"turns": [{"not": "text"}]})


def test_field_reader():
    assert get_reader("field", {"text": "body"})({"body": "hello"}) == "hello"


def test_json_that_is_not_json_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"instruction": "a"},\n {"instruction": ')
    with pytest.raises(DataSourceError, match=re.escape(str(bad))):
        list(iter_file_records(bad, "json"))


def test_eval_set_reader_counts_every_turn_and_is_strict(tmp_path):
    prompts = read_eval_prompts(FIX / "mt_bench.jsonl")
    assert len(prompts) == 6 and prompts[1] == "Now rewrite it so that every sentence begins with the letter P."
    # any reader by extension: a json array of alpaca records, a chat jsonl with all user turns
    assert read_eval_prompts(FIX / "gsm8k_train.jsonl")[2].startswith("Lena buys")  # `question` by key
    chat = tmp_path / "eval.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "one"},
                                             {"role": "assistant", "content": "x"},
                                             {"role": "user", "content": "two"}]}) + "\n")
    assert read_eval_prompts(chat) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n{"turns": [\n')
    with pytest.raises(DataSourceError, match=r"bad\.jsonl:2"):
        read_eval_prompts(bad)


def test_hub_corpus_offline_fails_with_a_clear_message(monkeypatch, tmp_path):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    with pytest.raises(DataSourceError, match=r"hf://ORG/nothing-here@[0-9a-f]{40}/train: cannot load hub "
                                              r"dataset.*offline"):
        load_hub_records("ORG/nothing-here", COMMIT, "train", None)


def test_hub_corpus_loads_at_the_pinned_revision(monkeypatch, tmp_path, tiny_qwen3_dir):
    import datasets

    calls = []

    def fake_load_dataset(repo_id, subset=None, *, split, revision):
        calls.append((repo_id, subset, split, revision))
        return datasets.Dataset.from_list([
            {"prompt": "p", "messages": [{"role": "user", "content": "hub question one"}], "extra": 1},
            {"prompt": "q", "messages": [{"role": "system", "content": "s"},
                                         {"role": "user", "content": "hub question two"}], "extra": 2}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    mpath = tmp_path / "m.json"
    mpath.write_text(json.dumps(manifest(hub_corpus(repo_id="HuggingFaceH4/ultrachat_200k", split="train_sft"))))
    res = build_prompts(PromptsConfig(manifest=str(mpath), out=str(tmp_path / "run" / "prompts.jsonl"),
                                      tokenizer=str(tiny_qwen3_dir), shuffle=False))
    assert calls == [("HuggingFaceH4/ultrachat_200k", None, "train_sft", COMMIT)]
    rows = [json.loads(line) for line in res.out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["hub question one", "hub question two"]
    stats = json.loads(res.stats_path.read_text())["corpora"]["hub"]
    assert stats["revision"] == COMMIT and stats["rows"] == 2


# ---------------------------------------------------------------------------------------------- templates

def test_templates_expand_deterministically_into_distinct_prompts_across_categories():
    tset = load_templates(templates_asset())
    assert set(tset.categories) == {"coding", "explanation", "writing", "math", "summarisation", "translation",
                                    "roleplay"}
    a = expand_templates(tset, 3000, seed=0)
    assert a == expand_templates(tset, 3000, seed=0)
    assert a != expand_templates(tset, 3000, seed=1)
    prompts = [p for _, p in a]
    assert len(set(prompts)) == 3000
    counts = {c: sum(1 for cat, _ in a if cat == c) for c in tset.categories}
    assert min(counts.values()) >= 3000 // 7 - 1  # balanced round robin
    assert not any(re.search(r"\{[a-z_]+\}", p) for p in prompts)  # every placeholder filled
    # a prefix of a longer expansion: asking for more never reshuffles what came before
    assert expand_templates(tset, 500, seed=0) == a[:500]


def test_templates_errors(tmp_path):
    small = tmp_path / "t.json"
    small.write_text(json.dumps({"categories": {"x": {"slots": {"a": ["1", "2"]}, "templates": ["n{a}"]}}}))
    assert sorted(p for _, p in expand_templates(load_templates(small), 2)) == ["n1", "n2"]
    with pytest.raises(TemplateError, match="only 2 distinct"):
        expand_templates(load_templates(small), 3)
    small.write_text(json.dumps({"categories": {"x": {"templates": ["uses {missing}"]}}}))
    with pytest.raises(TemplateError, match="missing"):
        load_templates(small)


# ------------------------------------------------------------------------------------------------ text

def test_normalise_prompt_keeps_indentation():
    raw = "  def f():\r\n      return 1   \r\n\r\n\r\n\r\nx\u00a0=\u00a02\n\n"
    assert normalise_prompt(raw) == "def f():\n      return 1\n\nx = 2"
    assert normalise_prompt(" \n\t ") == ""


def test_ngram_overlap_13_grams_and_short_identical():
    ev = ["Write a lively travel diary entry about a weekend spent exploring the old harbour town of Porto.",
          "Take a moment to check your answer."]
    train = [
        "Please WRITE a lively travel-diary entry about a weekend spent exploring... the old harbour!",  # 13 words
        "write a lively travel diary entry about a weekend spent exploring the old",  # 12 + 1 = 13 words
        "a lively travel diary entry about a weekend spent exploring the old",  # 12 words, not identical
        "TAKE a moment to check your answer!",  # short and identical after normalisation
        "Take a moment to check your answer twice.",  # short, not identical
        "Something else entirely.",
    ]
    found = ngram_overlap(train, ev, n=13)
    assert [i for i, _ in found] == [0, 1, 3]
    assert found[0][1] == "write a lively travel diary entry about a weekend spent exploring the old"
    assert found[2][1] == "take a moment to check your answer"
    keep, bad = contamination_filter(train, ev, n=13)
    assert keep == [2, 4, 5] and bad == found
    assert [i for i, _ in ngram_overlap(train, ev, n=12)] == [0, 1, 2, 3]  # 12 words now suffice


def test_jsonl_lines_survive_splitlines():
    from specdraft.core.io import jsonl_line

    text = "line\u2028separator\x85next\u2029para\nnewline"
    line = jsonl_line({"prompt": text})
    assert len(line.splitlines()) == 1 and json.loads(line)["prompt"] == text
    assert "é" in jsonl_line({"p": "é"})  # UTF-8 kept readable


def test_near_duplicates_minhash():
    base = ("A farmer has 40 sheep and buys 12 more at the market on Saturday. Each sheep eats 3 kilograms of hay "
            "a day, and a bale of hay weighs 20 kilograms. The barn can store at most 30 bales at a time, and the "
            "farmer visits the supplier only on Mondays. How many bales does the farmer need to feed all of the "
            "sheep for one full week, and how many trips to the supplier are needed over a month of four weeks?")
    texts_ = [base, base.replace("40", "41"), "Write a haiku about the sea.", "Explain how tides work.",
              base.replace("40 sheep", "40 goats").replace("market", "fair").replace("Saturday", "Monday")
              .replace("hay", "grass").replace("bales", "sacks")]
    found = near_duplicates(texts_, threshold=0.8, num_perm=64)
    assert found == [(1, 0)]
    assert near_duplicates(texts_) == found  # deterministic


# ---------------------------------------------------------------------------------------------- manifests

def test_shipped_default_manifest_is_the_builtin_one():
    assert json.loads((CONFIGS / "manifest.default.json").read_text()) == default_manifest_dict()
    loaded = load_manifest(CONFIGS / "manifest.default.json")
    assert {c.kind for c in loaded.corpora} == {"packaged"} and len(loaded.corpora) >= 8
    assert load_manifest(None).manifest == loaded.manifest


def test_qwen3_manifest_is_pinned_to_train_splits():
    loaded = load_manifest(CONFIGS / "manifest.qwen3-8b.json")
    hub = {c.repo_id: c for c in loaded.corpora if c.kind == "hf_dataset"}
    assert set(hub) == {"HuggingFaceH4/ultrachat_200k", "ise-uiuc/Magicoder-OSS-Instruct-75K"}
    assert hub["HuggingFaceH4/ultrachat_200k"].split == "train_sft"
    assert hub["ise-uiuc/Magicoder-OSS-Instruct-75K"].split == "train"
    assert all(re.fullmatch(r"[0-9a-f]{40}", c.revision) for c in hub.values())
    assert "templates" in [c.kind for c in loaded.corpora]
    assert "UNVERIFIED" in loaded.manifest.notes


@pytest.mark.skipif(not (SHARED / "data" / "train" / "README.md").is_file(), reason="needs ../shared")
def test_shared_manifest_matches_the_shared_readme():
    readme = (SHARED / "data" / "train" / "README.md").read_text()
    table = dict(re.findall(r"^\| `([^`]+)` \|[^\n]*?\| `([0-9a-f]{64})` \|", readme, re.M))
    assert len(table) == 8
    loaded = load_manifest(CONFIGS / "manifest.shared.json")  # also checks every file's sha256
    local = [c for c in loaded.corpora if c.kind == "local_file"]
    assert {Path(c.path).name: c.sha256 for c in local} == table
    for c in local:
        assert loaded.resolved[c.name] == (SHARED / "data" / "train" / Path(c.path).name).resolve()
        assert c.source and c.source.commit in readme and c.source.repo in readme
        assert c.license and c.license_notes
    assert "templates" in [c.kind for c in loaded.corpora]


def test_relative_paths_resolve_against_the_manifest_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "cfg").mkdir()
    shutil.copy(FIX / "gsm8k_train.jsonl", tmp_path / "data" / "g.jsonl")
    m = tmp_path / "cfg" / "m.json"
    m.write_text(json.dumps(manifest(local_corpus(path="../data/g.jsonl"))))
    monkeypatch.chdir(FIX)
    assert load_manifest(m).resolved["c"] == (tmp_path / "data" / "g.jsonl").resolve()


@pytest.mark.parametrize("revision", ["main", "v1.0", "0123456", None, "0123456789ABCDEF0123456789abcdef0123456g"])
def test_unpinned_revision_is_an_error(revision):
    with pytest.raises(ManifestError, match="'hub'"):
        parse_manifest_dict(manifest(hub_corpus(revision=revision)))


@pytest.mark.parametrize("split", ["test", "validation", "val", "dev", "eval", "test_sft", "validation[:10%]",
                                   "test_gen"])
def test_eval_split_in_a_train_corpus_is_an_error(split):
    with pytest.raises(ManifestError, match=r"'hub'.*evaluation split"):
        parse_manifest_dict(manifest(hub_corpus(split=split)))
    with pytest.raises(ManifestError, match=r"'c'.*evaluation split"):
        parse_manifest_dict(manifest(local_corpus(split=split)))


def test_train_splits_are_fine():
    for split in ("train", "train_sft", "train[:50%]"):
        parse_manifest_dict(manifest(hub_corpus(split=split)))


def test_sha256_mismatch_names_the_file_and_both_hashes():
    path = FIX / "gsm8k_train.jsonl"
    with pytest.raises(ManifestError) as e:
        parse_manifest_dict(manifest(local_corpus(sha256=SHA_A)))
    assert str(path) in str(e.value) and SHA_A in str(e.value) and sha(path) in str(e.value)


def test_unknown_reader_names_the_corpus():
    with pytest.raises(ManifestError, match=r"corpus 'c'.*unknown reader 'sharegpt_v9'"):
        parse_manifest_dict(manifest(local_corpus(reader="sharegpt_v9")))


@pytest.mark.parametrize("change, pattern", [
    ({"uses_eval_splits": True}, "uses_eval_splits"),
    ({"eval_examples_used_as_targets": True}, "eval_examples_used_as_targets"),
    ({"schema_version": 2}, "schema_version"),
])
def test_top_level_declarations(change, pattern):
    with pytest.raises(ManifestError, match=pattern):
        parse_manifest_dict(manifest(local_corpus(), **change))


@pytest.mark.parametrize("corpus, pattern", [
    (local_corpus(path="/nonexistent/file.jsonl"), r"corpus 'c'.*/nonexistent/file\.jsonl does not exist"),
    (local_corpus(sha256=None), r"corpus 'c'.*needs sha256"),
    (local_corpus(format=None), r"corpus 'c'.*needs format"),
    (hub_corpus(repo_id=None), r"corpus 'hub'.*needs repo_id"),
    (local_corpus(fields={"nope": "x"}), r"corpus 'c'.*no field\(s\) nope"),
    (local_corpus(reader="field"), r"corpus 'c'.*needs fields.text"),
    (local_corpus(reader="templates"), r"corpus 'c'"),
    (local_corpus(role="eval"), r"corpus 'c'.*role"),
    (local_corpus(sha256="ABC"), r"corpus 'c'.*sha256"),
    (local_corpus(source={"repo": "a/b", "commit": "main"}), r"corpus 'c'.*source.commit"),
])
def test_manifest_corpus_errors(corpus, pattern):
    with pytest.raises(ManifestError, match=pattern):
        parse_manifest_dict(manifest(corpus))


def test_duplicate_corpus_names_and_bad_json(tmp_path):
    with pytest.raises(ManifestError, match="repeated: c"):
        parse_manifest_dict(manifest(local_corpus(), local_corpus()))
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    with pytest.raises(ManifestError, match=re.escape(str(bad))):
        load_manifest(bad)


# -------------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory, tiny_qwen3_dir):
    out = tmp_path_factory.mktemp("run") / "prompts.jsonl"
    cfg = PromptsConfig(manifest=str(FIX / "manifest.json"), out=str(out), tokenizer=str(tiny_qwen3_dir),
                        max_prompt_tokens=400, eval_set=[str(FIX / "mt_bench.jsonl")])
    return cfg, build_prompts(cfg)


def test_prompts_end_to_end(fixture_run):
    cfg, res = fixture_run
    rows = [json.loads(line) for line in res.out.read_text().splitlines()]
    assert all({"id", "source", "prompt"} <= set(r) <= {"id", "source", "prompt", "response", "followup"}
               for r in rows)
    assert all(r["source"] in ("ultrachat_parquet", "ultrachat_jsonl", "sharegpt") for r in rows if "followup" in r)
    with_answer = {r["source"] for r in rows if "response" in r}
    assert "gsm8k" in with_answer and "templates" not in with_answer  # templates have no reference answer
    assert len({r["id"] for r in rows}) == len(rows) == res.total
    assert len({" ".join(r["prompt"].split()) for r in rows}) == len(rows)  # no exact duplicates
    stats = json.loads(res.stats_path.read_text())
    c = stats["corpora"]
    for name, s in c.items():  # every record is accounted for
        assert s["read"] == s["kept"] + sum(s["dropped"].values()), name
        assert s["kept"] == sum(1 for r in rows if r["source"] == name)
        assert s["with_response"] == sum(1 for r in rows if r["source"] == name and "response" in r)
    assert c["ultrachat_jsonl"]["dropped"]["duplicate"] == 3  # same prompts as the parquet, which comes first
    assert c["ultrachat_jsonl"]["dropped"]["malformed"] == 1
    assert c["prompts_only"]["dropped"]["duplicate"] == 1  # whitespace variant
    assert c["alpaca"]["dropped"] == {**{k: 0 for k in c["alpaca"]["dropped"]},
                                      "malformed": 2, "too_long": 1, "duplicate": 1}
    assert c["sharegpt"]["dropped"]["no_prompt"] == 1 and c["sharegpt"]["dropped"]["empty"] == 1
    assert c["gsm8k"]["dropped"]["near_duplicate"] == 1
    assert c["templates"]["kept"] == 20 and c["templates"]["dropped"]["over_quota"] == 20
    assert c["sharegpt"]["malformed_examples"][0] == f"{FIX / 'sharegpt.jsonl'}:5: " + \
        c["sharegpt"]["malformed_examples"][0].split(": ", 1)[1]
    assert any(m.startswith(f"{FIX / 'alpaca.json'}:17:") for m in c["alpaca"]["malformed_examples"])


def test_prompts_contamination_is_dropped_and_reported(fixture_run):
    cfg, res = fixture_run
    rows = [json.loads(line) for line in res.out.read_text().splitlines()]
    stats = json.loads(res.stats_path.read_text())
    assert stats["contamination"]["dropped"] == 2 == res.contaminated
    assert stats["corpora"]["instructionwild"]["dropped"]["contaminated"] == 2
    assert {e["index"] for e in stats["contamination"]["examples"]} == {1, 2}
    eval_prompts = read_eval_prompts(FIX / "mt_bench.jsonl")
    assert ngram_overlap([r["prompt"] for r in rows], eval_prompts, 13) == []
    assert "Now rewrite it so that every sentence begins with the letter Q." in [r["prompt"] for r in rows]
    assert stats["contamination"]["eval_sets"][0]["sha256"] == sha(FIX / "mt_bench.jsonl")


def test_contaminated_reference_answer_is_removed_and_counted(tmp_path, tiny_qwen3_dir):
    leak = "Write a lively travel diary entry about a weekend spent exploring the old harbour town of Porto"
    corpus = tmp_path / "qa.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "How do I plan a weekend trip?", "answer": f"Start here. {leak.lower()}, then relax."},
        {"question": "What is two plus two?", "answer": "Two plus two is four."},
        {"question": leak + ".", "answer": "A clean answer to a contaminated prompt."}]))
    m = tmp_path / "m.json"
    m.write_text(json.dumps(manifest(local_corpus(name="qa", path=str(corpus), sha256=sha(corpus)))))
    res = build_prompts(PromptsConfig(manifest=str(m), out=str(tmp_path / "o" / "prompts.jsonl"),
                                      tokenizer=str(tiny_qwen3_dir), eval_set=[str(FIX / "mt_bench.jsonl")]))
    rows = {r["prompt"]: r for r in map(json.loads, res.out.read_text().splitlines())}
    assert set(rows) == {"How do I plan a weekend trip?", "What is two plus two?"}  # the prompt stays
    assert "response" not in rows["How do I plan a weekend trip?"]
    assert rows["What is two plus two?"]["response"] == "Two plus two is four."
    stats = json.loads(res.stats_path.read_text())
    qa = stats["corpora"]["qa"]
    assert qa["response_contaminated"] == 1 and qa["dropped"]["contaminated"] == 1 and qa["with_response"] == 1
    assert stats["contamination"]["responses_removed"] == 1
    (example,) = stats["contamination"]["response_examples"]
    assert example["index"] == 0 and example["ngram"] == " ".join(leak.lower().split()[:13])


def test_prompts_provenance(fixture_run):
    cfg, res = fixture_run
    run_dir = res.out.parent
    stats = json.loads(res.stats_path.read_text())
    prov = stats["provenance"]
    assert (run_dir / "data_manifest.json").read_bytes() == (FIX / "manifest.json").read_bytes()
    assert prov["manifest"]["sha256"] == sha(FIX / "manifest.json")
    assert prov["manifest"]["content"] == json.loads((FIX / "manifest.json").read_text())
    assert stats["prompts_sha256"] == sha(res.out)
    files = {f["corpus"]: f for f in prov["files"]}
    assert files["alpaca"]["sha256"] == sha(FIX / "alpaca.json")
    assert files["alpaca"]["resolved_path"] == str(FIX / "alpaca.json")
    assert files["templates"]["sha256"] == sha(templates_asset())
    assert prov["config"] == cfg.to_json_dict()
    assert {"git_sha", "versions", "created_at"} <= set(prov["run"])
    assert prov["tokenizer"]["fast"] is True and len(prov["tokenizer"]["fingerprint"]) == 64
    assert (run_dir / "prompts.log").read_text().count("wrote") == 1


def test_prompts_are_deterministic_and_seeded(fixture_run, tmp_path):
    cfg, res = fixture_run
    again = build_prompts(cfg.model_copy(update={"out": str(tmp_path / "a" / "prompts.jsonl")}))
    assert again.out.read_bytes() == res.out.read_bytes()
    other = build_prompts(cfg.model_copy(update={"out": str(tmp_path / "b" / "prompts.jsonl"), "seed": 1}))
    first = {json.loads(x)["id"] for x in res.out.read_text().splitlines()}
    second = {json.loads(x)["id"] for x in other.out.read_text().splitlines()}
    assert first != second and len(first) == len(second)  # another quota sample of the templates


def test_prompts_cli(tmp_path, tiny_qwen3_dir):
    from specdraft.cli import main

    out = tmp_path / "cli" / "prompts.jsonl"
    eval2 = tmp_path / "eval2.jsonl"
    eval2.write_text(json.dumps({"turns": ["What is a good name for a bakery that sells only sourdough?"]}) + "\n")
    rc = main(["prompts", "--manifest", str(FIX / "manifest.json"), "--out", str(out), "--tokenizer",
               str(tiny_qwen3_dir), "--eval-set", str(FIX / "mt_bench.jsonl"), "--eval-set", str(eval2),
               "--no-near-dup", "--max-prompt-tokens", "400"])
    assert rc == 0
    stats = json.loads(out.with_name("prompts.stats.json").read_text())
    assert len(stats["contamination"]["eval_sets"]) == 2
    assert stats["contamination"]["dropped"] == 3  # the two of mt_bench + the sharegpt bakery question
    assert stats["corpora"]["gsm8k"]["dropped"]["near_duplicate"] == 0  # --no-near-dup
    assert stats["provenance"]["config"]["eval_set"] == [str(FIX / "mt_bench.jsonl"), str(eval2)]


def test_manifest_error_stops_the_stage(tmp_path, tiny_qwen3_dir):
    m = tmp_path / "m.json"
    data = json.loads((FIX / "manifest.json").read_text())
    bad = copy.deepcopy(data)
    bad["corpora"][0]["sha256"] = SHA_A
    bad["corpora"][0]["path"] = str(FIX / bad["corpora"][0]["path"])
    m.write_text(json.dumps(bad))
    with pytest.raises(ManifestError, match="sha256 mismatch"):
        build_prompts(PromptsConfig(manifest=str(m), out=str(tmp_path / "o" / "prompts.jsonl"),
                                    tokenizer=str(tiny_qwen3_dir)))
    assert not (tmp_path / "o" / "prompts.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "train").is_dir(), reason="needs ../shared")
def test_shared_manifest_yields_15k_clean_prompts(tmp_path):
    """The stage's acceptance check on the real files, with the embedded target's tokenizer (~30 s)."""
    res = build_prompts(PromptsConfig(manifest=str(CONFIGS / "manifest.shared.json"),
                                      out=str(tmp_path / "prompts.jsonl"),
                                      eval_set=[str(SHARED / "data" / "dev" / "mt_bench.jsonl")]))
    rows = [json.loads(line)["prompt"] for line in res.out.read_text().splitlines()]
    assert len(rows) >= 15_000 and len(set(rows)) == len(rows)
    assert ngram_overlap(rows, read_eval_prompts(SHARED / "data" / "dev" / "mt_bench.jsonl"), 13) == []
