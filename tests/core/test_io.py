"""specdraft.core.io: hashes, atomic writes, the JSON/JSONL readers and writer, safetensors headers."""

import hashlib
import json
import os
import stat
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.core.io import (
    COMMIT_RE,
    SHA256_RE,
    RecordFileError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    drop_last_group,
    jsonl_line,
    make_shareable_dir,
    make_shareable_file,
    read_json,
    read_jsonl,
    repair_jsonl,
    safetensors_header,
    safetensors_problem,
    safetensors_shapes,
    sha256_bytes,
    sha256_file,
    sha256_files,
    text_lines,
)

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 test vector


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# ------------------------------------------------------------------------------------------------ hashes

def test_sha256_of_bytes_and_files_are_the_standard_digests(tmp_path):
    assert sha256_bytes(b"") == EMPTY_SHA256
    assert sha256_bytes(b"abc") == ABC_SHA256
    f = tmp_path / "abc.bin"
    f.write_bytes(b"abc")
    assert sha256_file(f) == ABC_SHA256
    assert sha256_file(str(f)) == ABC_SHA256
    assert SHA256_RE.fullmatch(sha256_file(f))


def test_sha256_file_does_not_depend_on_the_chunk_size(tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert {sha256_file(f, chunk_size=n) for n in (1, 7, 4096, 1 << 20)} == {expected}


def test_sha256_files_hashes_contents_in_order_not_names(tmp_path):
    a, b, a2 = tmp_path / "a", tmp_path / "b", tmp_path / "another_name"
    a.write_bytes(b"abc")
    b.write_bytes(b"")
    a2.write_bytes(b"abc")
    expected = hashlib.sha256(bytes.fromhex(ABC_SHA256) + bytes.fromhex(EMPTY_SHA256)).hexdigest()
    assert sha256_files([a, b]) == expected
    assert sha256_files([a2, b]) == expected  # names are not hashed
    assert sha256_files([b, a]) != expected  # order is
    assert sha256_files([]) == EMPTY_SHA256
    # not the digest of the concatenation: "ab" + "c" and "a" + "bc" differ
    (tmp_path / "ab").write_bytes(b"ab")
    (tmp_path / "c").write_bytes(b"c")
    (tmp_path / "a1").write_bytes(b"a")
    (tmp_path / "bc").write_bytes(b"bc")
    assert sha256_files([tmp_path / "ab", tmp_path / "c"]) != sha256_files([tmp_path / "a1", tmp_path / "bc"])


def test_commit_and_sha256_patterns():
    assert COMMIT_RE.fullmatch("0123456789abcdef0123456789abcdef01234567")
    assert not COMMIT_RE.fullmatch("0123456789ABCDEF0123456789ABCDEF01234567")  # lower case only
    assert not COMMIT_RE.fullmatch("main")
    assert SHA256_RE.fullmatch(EMPTY_SHA256) and not SHA256_RE.fullmatch(EMPTY_SHA256[:40])


# ------------------------------------------------------------------------------------------ atomic writes

def test_atomic_write_creates_parents_replaces_and_leaves_no_temp(tmp_path, umask_022):
    path = tmp_path / "deep" / "er" / "out.bin"
    atomic_write_bytes(path, b"first")
    atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert _leftovers(path.parent) == [] and sorted(p.name for p in path.parent.iterdir()) == ["out.bin"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600


def test_atomic_write_mode_follows_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "x.txt", "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "x.txt").stat().st_mode) == 0o640


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    path.write_text("old")

    def interrupted(fd):
        raise KeyboardInterrupt  # a BaseException, as a Ctrl-C half-way would be
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, b"new contents")
    assert path.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_leaves_no_temp(tmp_path):
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "child").write_text("x")  # a non-empty folder cannot be replaced by a file
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"data")
    assert target.is_dir() and (target / "child").read_text() == "x"
    assert _leftovers(tmp_path) == []


def test_atomic_write_text_is_utf8_and_json_is_indented_with_a_newline(tmp_path):
    atomic_write_text(tmp_path / "t.txt", "é€\n")
    assert (tmp_path / "t.txt").read_bytes() == "é€\n".encode("utf-8")
    atomic_write_json(tmp_path / "j.json", {"b": 1, "a": [1, 2], "p": tmp_path / "x"})
    text = (tmp_path / "j.json").read_text()
    assert text == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ],\n  "p": "' + str(tmp_path / "x") + '"\n}\n'
    assert read_json(tmp_path / "j.json") == {"b": 1, "a": [1, 2], "p": str(tmp_path / "x")}  # key order kept


def test_make_shareable_gives_the_umask_mode(tmp_path, umask_022):
    d, f = tmp_path / "d", tmp_path / "f"
    d.mkdir(mode=0o700)
    f.write_text("")
    f.chmod(0o600)
    make_shareable_dir(d)
    make_shareable_file(f)
    assert (stat.S_IMODE(d.stat().st_mode), stat.S_IMODE(f.stat().st_mode)) == (0o755, 0o644)
    assert os.umask(0o022) == 0o022  # reading the umask left it as it was


# ------------------------------------------------------------------------------------------------ reading

def test_read_json_returns_an_object(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"x": [1, "é"]}')
    assert read_json(p) == {"x": [1, "é"]}


@pytest.mark.parametrize("content, says", [
    (b'{"x": 1', "not valid JSON (Expecting ',' delimiter at line 1, column 8)"),
    (b"", "not valid JSON (Expecting value at line 1, column 1)"),
    (b'{"x": "\xff"}', "not UTF-8 text (invalid start byte at byte 7)"),
    (b"[1, 2]", "expected a JSON object, found list"),
    (b"null", "expected a JSON object, found NoneType"),
])
def test_read_json_names_the_file_and_the_problem(tmp_path, content, says):
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_json(p)
    assert str(e.value) == f"{p}: {says}"


def test_text_lines_skips_blank_lines_but_keeps_their_numbers(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"one\n\n   \ntwo\r\n\xc3\xa9")
    assert list(text_lines(p)) == [(1, "one\n"), (4, "two\r\n"), (5, "é")]


def test_text_lines_names_the_line_that_is_not_utf8(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"ok\n\nbad \xe9 byte\n")
    with pytest.raises(ValueError) as e:
        list(text_lines(p))
    assert str(e.value) == f"{p}:3: not UTF-8 text (invalid continuation byte at byte 4)"


# -------------------------------------------------------------------------------------------------- JSONL

def test_jsonl_line_is_compact_and_keeps_utf8():
    assert jsonl_line({"a": [1, 2], "b": "é€", "c": None}) == '{"a":[1,2],"b":"é€","c":null}'
    assert jsonl_line("x\ny") == '"x\\ny"'
    assert jsonl_line("\x85\u2028\u2029") == '"\\u0085\\u2028\\u2029"'
    assert not jsonl_line({"a": 1}).endswith("\n")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from("ab é\n\r\t\"\\\x00\x85\u2028\u2029\u00a0€😀")) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=8)


@settings(max_examples=40, deadline=None)
@given(st.lists(json_values, min_size=1, max_size=4))
def test_jsonl_rows_round_trip_through_a_file(tmp_path_factory, rows):
    lines = [jsonl_line(r) for r in rows]
    assert all(len(line.splitlines()) == 1 for line in lines)  # one row, one line, for every line splitter
    path = tmp_path_factory.mktemp("rt") / "rows.jsonl"
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    assert list(read_jsonl(path)) == [(i, r) for i, r in enumerate(rows, 1)]
    assert [json.loads(line) for _, line in text_lines(path)] == rows
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows


def test_read_jsonl_skips_blank_lines_and_names_a_bad_one(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"id": "a"}\n\n[1]\n')
    assert list(read_jsonl(p)) == [(1, {"id": "a"}), (3, [1])]
    p.write_text('{"id": "a"}\n{"id": \n{"id": "c"}\n')
    with pytest.raises(RecordFileError, match=rf"^{p}:2: not valid JSON \(Expecting value\); the file is damaged"):
        list(read_jsonl(p))
    assert issubclass(RecordFileError, ValueError)


def test_read_jsonl_names_a_line_that_is_not_utf8(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_bytes(b'{"id": "a"}\n{"id": "\xff"}\n')
    with pytest.raises(RecordFileError, match=rf"^{p}:2: not UTF-8 text .*the file is damaged"):
        list(read_jsonl(p))


def test_a_lone_surrogate_is_escaped_so_the_row_can_be_written(tmp_path):
    value = json.loads('{"id": "\\ud83d x"}')  # json accepts it; UTF-8 cannot encode it
    line = jsonl_line(value)
    assert line == '{"id":"\\ud83d x"}'
    p = tmp_path / "rows.jsonl"
    p.write_text(line + "\n", encoding="utf-8")
    assert list(read_jsonl(p)) == [(1, value)]


def test_repair_jsonl_on_a_missing_or_complete_file_cuts_nothing(tmp_path):
    assert repair_jsonl(tmp_path / "missing.jsonl") == 0
    assert not (tmp_path / "missing.jsonl").exists()
    p = tmp_path / "ok.jsonl"
    p.write_bytes(b"")
    assert repair_jsonl(p) == 0 and p.read_bytes() == b""


def test_repair_jsonl_finds_the_last_newline_beyond_one_chunk(tmp_path, caplog):
    p = tmp_path / "x.jsonl"
    torn = b'{"id": "' + b"x" * 200_000  # longer than the 64 KiB blocks it reads backwards
    p.write_bytes(b'{"id": "a"}\n' + torn)
    with caplog.at_level("WARNING", logger="specdraft.core.io"):
        assert repair_jsonl(p) == len(torn)
    assert p.read_bytes() == b'{"id": "a"}\n'
    assert "discarded a torn last line" in caplog.text and str(p) in caplog.text
    exact = b"y" * ((1 << 16) - 1) + b"\n"  # the newline is the last byte of the first block read
    p.write_bytes(exact + b"z" * (1 << 16))
    assert repair_jsonl(p) == 1 << 16 and p.read_bytes() == exact


@settings(max_examples=30, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from("ab"), st.integers()), max_size=4),
       st.binary(max_size=40).filter(lambda b: b"\n" not in b))
def test_repair_jsonl_keeps_exactly_the_complete_lines(tmp_path_factory, rows, tail):
    good = "".join(jsonl_line(r) + "\n" for r in rows).encode()
    p = tmp_path_factory.mktemp("repair") / "x.jsonl"
    p.write_bytes(good + tail)
    assert repair_jsonl(p) == len(tail)
    assert p.read_bytes() == good
    assert [v for _, v in read_jsonl(p)] == rows


def test_drop_last_group_cuts_the_last_ids_lines(tmp_path):
    p = tmp_path / "v.jsonl"
    lines = ['{"id":"a","o":0}', '{"id":"a","o":1}', '{"id":"b","o":0}', '{"id":"c","o":0}', '{"id":"c","o":1}']
    p.write_text("\n".join(lines) + "\n")
    assert drop_last_group(p) == "c"
    assert p.read_text() == "\n".join(lines[:3]) + "\n"
    assert drop_last_group(p) == "b"
    assert p.read_text() == "\n".join(lines[:2]) + "\n"
    assert drop_last_group(p) == "a" and p.read_bytes() == b""
    assert drop_last_group(p) is None
    assert drop_last_group(tmp_path / "missing.jsonl") is None


def test_drop_last_group_uses_the_key_given_and_only_the_last_run_of_it(tmp_path):
    p = tmp_path / "v.jsonl"
    p.write_text('{"k":1}\n{"k":2}\n{"k":1}\n{"k":1}\n')
    assert drop_last_group(p, key="k") == 1
    assert p.read_text() == '{"k":1}\n{"k":2}\n'


@pytest.mark.parametrize("bad", ["[1, 2]", '{"other": 1}', "{not json", '"a string"'])
def test_drop_last_group_names_a_damaged_line_and_cuts_nothing(tmp_path, bad):
    p = tmp_path / "v.jsonl"
    content = '{"id": "a"}\n' + bad + '\n{"id": "b"}\n'
    p.write_text(content)
    with pytest.raises(RecordFileError, match=rf"^{p}:2: not a JSON object with 'id'"):
        drop_last_group(p)
    assert p.read_text() == content


def test_drop_last_group_skips_blank_lines_and_names_one_that_is_not_utf8(tmp_path):
    p = tmp_path / "v.jsonl"
    p.write_text('{"id":"a"}\n\n{"id":"b"}\n')
    assert drop_last_group(p) == "b"
    assert p.read_text() == '{"id":"a"}\n\n'
    content = b'{"id":"a"}\n{"id":"\xff"}\n'
    p.write_bytes(content)
    with pytest.raises(RecordFileError, match=rf"^{p}:2: not a JSON object with 'id'"):
        drop_last_group(p)
    assert p.read_bytes() == content


# ------------------------------------------------------------------------------------------- safetensors

def _safetensors(path, header: dict, data: bytes = b"", pad_header: int = 0):
    raw = json.dumps(header).encode() + b" " * pad_header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


HEADER = {"__metadata__": {"format": "pt"},
          "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "b": {"dtype": "F32", "shape": [3], "data_offsets": [24, 36]}}


def test_safetensors_header_and_shapes_of_a_sound_file(tmp_path):
    p = _safetensors(tmp_path / "m.safetensors", HEADER, bytes(36), pad_header=3)
    assert safetensors_header(p) == HEADER
    assert safetensors_shapes(p) == {"w": [2, 3], "b": [3]}
    assert safetensors_problem(p) is None


def test_safetensors_written_by_the_library_are_sound(tmp_path):
    np = pytest.importorskip("numpy")
    save_file = pytest.importorskip("safetensors.numpy").save_file
    p = tmp_path / "lib.safetensors"
    save_file({"emb": np.zeros((4, 2), dtype=np.float16), "bias": np.ones(5, dtype=np.float32)}, str(p))
    assert safetensors_shapes(p) == {"emb": [4, 2], "bias": [5]}
    assert safetensors_problem(p) is None


def test_safetensors_problem_names_truncation_and_trailing_bytes(tmp_path):
    p = _safetensors(tmp_path / "m.safetensors", HEADER, bytes(30))
    header_len = len(json.dumps(HEADER))
    assert safetensors_problem(p) == f"truncated: {8 + header_len + 30:,} bytes, the header's tensors need " \
                                     f"{8 + header_len + 36:,}"
    _safetensors(p, HEADER, bytes(40))
    assert safetensors_problem(p) == f"4 bytes after the last tensor (expected {8 + header_len + 36:,} bytes in all)"
    _safetensors(p, {"w": {"shape": [1], "data_offsets": [0]}}, bytes(4))
    assert safetensors_problem(p) == "a tensor's data_offsets are not two integers"
    _safetensors(p, {"__metadata__": {}})
    assert safetensors_problem(p) is None  # no tensors: the header alone


@pytest.mark.parametrize("content, says", [
    (b"\x01\x02", "2 bytes: shorter than the 8-byte header length"),
    (struct.pack("<Q", 100) + b"{}", "truncated: the header claims 100 bytes, 2 follow its length"),
    (struct.pack("<Q", 3) + b"{x}", "the header is not JSON"),
    (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
])
def test_unreadable_safetensors_headers_are_named(tmp_path, content, says):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        safetensors_header(p)
    assert str(e.value).startswith(f"{p}: {says}")
    problem = safetensors_problem(p)
    assert problem.startswith(says) and str(p) not in problem  # the caller names the file


def test_atomic_file_and_dir_appear_whole_or_not_at_all(tmp_path):
    import os

    import pytest

    from specdraft.core.io import atomic_dir, atomic_file
    out = tmp_path / "a" / "f.bin"
    with atomic_file(out) as tmp:
        tmp.write_bytes(b"one")
        assert not out.exists() and tmp.parent == out.parent
    assert out.read_bytes() == b"one" and oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(RuntimeError):
        with atomic_file(out) as tmp:
            tmp.write_bytes(b"two")
            raise RuntimeError("killed half way")
    assert out.read_bytes() == b"one" and sorted(os.listdir(out.parent)) == ["f.bin"]
    d = tmp_path / "d"
    for content in ("old", "new"):
        with atomic_dir(d) as tmp:
            (tmp / "x").write_text(content)
    assert (d / "x").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a", "d"]
    with pytest.raises(RuntimeError):
        with atomic_dir(d) as tmp:
            (tmp / "x").write_text("torn")
            raise RuntimeError("killed")
    assert (d / "x").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a", "d"]


def _umask() -> int:
    import os
    mask = os.umask(0)
    os.umask(mask)
    return mask
