"""toolkit.logtail: the end of plain and gzip logs, bounded, never failing on bad bytes."""

import gzip
import io
import time
import tracemalloc

import pytest

from toolkit.errors import HpcmemError
from toolkit.logtail import DEFAULT_MAX_BYTES, LogError, Tail, read_head, read_stream_tail, read_tail


def numbered(n: int) -> bytes:
    return b"".join(b"line %d\n" % i for i in range(1, n + 1))


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------ plain files


def test_small_plain_file_is_read_whole(tmp_path):
    path = write(tmp_path, "a.log", b"one\ntwo\n")
    assert read_tail(path) == Tail("one\ntwo\n", 1, False)


def test_tail_unpacks_as_text_first_line_truncated(tmp_path):
    text, first, truncated = read_tail(write(tmp_path, "a.log", b"x\n"))
    assert (text, first, truncated) == ("x\n", 1, False)


def test_large_plain_file_keeps_only_whole_last_lines(tmp_path):
    data = numbered(1000)
    tail = read_tail(write(tmp_path, "a.log", data), max_bytes=100)
    assert tail.truncated and tail.first_line is None and not tail.damaged
    assert len(tail.text.encode()) <= 100
    assert tail.text.startswith("line ") and tail.text.endswith("line 1000\n")
    assert data.decode().endswith(tail.text)


def test_cut_right_after_a_newline_keeps_that_line(tmp_path):
    # the last 10 bytes are exactly "line 1000\n"; the byte before them is a newline
    tail = read_tail(write(tmp_path, "a.log", numbered(1000)), max_bytes=10)
    assert tail.text == "line 1000\n"


def test_tail_without_newline_is_kept_whole(tmp_path):
    tail = read_tail(write(tmp_path, "a.log", b"x" * 50), max_bytes=20)
    assert tail.text == "x" * 20 and tail.truncated


def test_file_of_exactly_max_bytes_is_not_truncated(tmp_path):
    tail = read_tail(write(tmp_path, "a.log", b"abc\ndef\n"), max_bytes=8)
    assert tail == Tail("abc\ndef\n", 1, False)


def test_empty_file(tmp_path):
    assert read_tail(write(tmp_path, "empty.log", b"")) == Tail("", 1, False)


def test_binary_garbage_becomes_text(tmp_path):
    data = bytes(range(256)) * 4 + b"\n\xff\xfe tail line \xc3\n"
    tail = read_tail(write(tmp_path, "garbage.log", data))
    assert "\ufffd" in tail.text and "tail line" in tail.text


def test_character_cut_at_the_boundary_is_dropped_not_raised(tmp_path):
    tail = read_tail(write(tmp_path, "u.log", ("é" * 100).encode()), max_bytes=51)
    assert tail.text == "é" * 25


def test_sparse_2gb_log_costs_no_more_than_a_small_one(tmp_path):
    path = tmp_path / "huge.log"
    with open(path, "wb") as f:
        f.seek(2 * 2**30)
        f.write(b"\nlast words\n")
    start = time.monotonic()
    tail = read_tail(path)
    assert time.monotonic() - start < 2.0
    assert tail.text.endswith("last words\n") and tail.truncated
    assert len(tail.text.encode()) <= DEFAULT_MAX_BYTES


# ------------------------------------------------------------------ gzip


def test_gzip_small(tmp_path):
    assert read_tail(write(tmp_path, "a.log.gz", gzip.compress(b"a\nb\n"))) == Tail("a\nb\n", 1, False)


def test_gzip_tail_knows_its_first_line_number(tmp_path):
    data = numbered(200_000)
    tail = read_tail(write(tmp_path, "a.log.gz", gzip.compress(data)), max_bytes=1000)
    assert tail.truncated and not tail.damaged
    assert tail.text.endswith("line 200000\n")
    assert tail.text.startswith(f"line {tail.first_line}\n")
    assert data.decode().endswith(tail.text)


def test_gzip_cut_right_after_a_newline(tmp_path):
    tail = read_tail(write(tmp_path, "a.gz", gzip.compress(numbered(1000))), max_bytes=10)
    assert tail == Tail("line 1000\n", 1000, True)


def test_gzip_is_recognised_by_content_not_name(tmp_path):
    assert read_tail(write(tmp_path, "slurm-1.out", gzip.compress(b"zipped\n"))).text == "zipped\n"
    assert read_tail(write(tmp_path, "plain.gz", b"not zipped\n")).text == "not zipped\n"


def test_gzip_concatenated_members_and_zero_padding(tmp_path):
    data = gzip.compress(b"a\nb\n") + gzip.compress(b"c\n") + b"\0" * 16
    assert read_tail(write(tmp_path, "m.gz", data)) == Tail("a\nb\nc\n", 1, False)


def test_truncated_gzip_gives_what_could_be_decompressed(tmp_path):
    data = numbered(100_000)
    packed = gzip.compress(data)
    tail = read_tail(write(tmp_path, "cut.gz", packed[: len(packed) // 2]))
    assert tail.damaged and tail.truncated and tail.first_line == 1
    assert tail.text and data.decode().startswith(tail.text)


def test_corrupt_gzip_body_is_flagged_not_raised(tmp_path):
    packed = bytearray(gzip.compress(numbered(1000)))
    packed[30:60] = b"\xff" * 30
    tail = read_tail(write(tmp_path, "bad.gz", bytes(packed)))
    assert tail.damaged and tail.truncated


def test_garbage_after_a_gzip_member_is_flagged(tmp_path):
    tail = read_tail(write(tmp_path, "g.gz", gzip.compress(b"ok\n") + b"garbage"))
    assert tail.text == "ok\n" and tail.damaged


def test_gzip_header_only(tmp_path):
    tail = read_tail(write(tmp_path, "h.gz", b"\x1f\x8b"))
    assert tail.text == "" and tail.damaged


def peak_bytes(read):
    """``read()``'s result and the peak of Python memory allocated while it ran (bytes)."""
    tracemalloc.start()
    try:
        result = read()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_gzip_memory_stays_bounded(tmp_path):
    # 64 MiB of text, read with a 1 MiB window: peak memory stays a few MiB.
    path = write(tmp_path, "big.gz", gzip.compress((b"y" * 99 + b"\n") * (64 * 2**20 // 100)))
    tail, peak = peak_bytes(lambda: read_tail(path, max_bytes=2**20))
    assert tail.text.endswith("y" * 99 + "\n") and len(tail.text) <= 2**20
    assert peak < 8 * 2**20


# ------------------------------------------------------------------ errors


def test_missing_file_raises_one_line_log_error(tmp_path):
    with pytest.raises(LogError) as err:
        read_tail(tmp_path / "nope.log")
    assert isinstance(err.value, HpcmemError)
    assert "nope.log" in str(err.value) and "\n" not in str(err.value)


def test_directory_raises_log_error(tmp_path):
    with pytest.raises(LogError):
        read_tail(tmp_path)


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_max_bytes(tmp_path, bad):
    with pytest.raises(ValueError):
        read_tail(write(tmp_path, "a.log", b"x"), max_bytes=bad)


def test_number_lines_counts_the_skipped_head(tmp_path):
    path = tmp_path / "big.log"
    lines = [f"line {i}" for i in range(1, 5001)]
    path.write_text("\n".join(lines) + "\n")
    tail = read_tail(path, 1000, number_lines=True)
    first = tail.text.split("\n")[0]
    assert tail.truncated and first == f"line {tail.first_line}"
    assert read_tail(path, 1000).first_line is None


# ------------------------------------------------------------------ streams (standard input) and heads


class Trickle(io.RawIOBase):
    """A pipe-like stream: no seek, and reads hand over at most ``step`` bytes (a real pipe may give less)."""

    def __init__(self, data: bytes, step: int = 7919):
        self.data, self.pos, self.step = data, 0, step

    def readable(self):
        return True

    def readinto(self, buffer):
        piece = self.data[self.pos: self.pos + min(len(buffer), self.step)]
        buffer[: len(piece)] = piece
        self.pos += len(piece)
        return len(piece)


def test_stream_keeps_the_end_and_knows_the_line_numbers():
    data = numbered(200_000)
    tail = read_stream_tail(Trickle(data), max_bytes=1000, head_bytes=20)
    assert tail.truncated and not tail.damaged and tail.size == len(data)
    assert tail.text.endswith("line 200000\n") and tail.text.startswith(f"line {tail.first_line}\n")
    assert data.decode().endswith(tail.text)
    assert tail.head == "line 1\nline 2\nline 3"


def test_stream_small_plain_gzip_and_empty():
    assert read_stream_tail(io.BytesIO(b"a\nb\n")) == Tail("a\nb\n", 1, False)
    members = gzip.compress(b"a\nb\n") + gzip.compress(b"c\n")
    assert read_stream_tail(Trickle(members, step=1)) == Tail("a\nb\nc\n", 1, False)
    empty = read_stream_tail(io.BytesIO(b""))
    assert empty == Tail("", 1, False) and not empty.damaged and empty.size == 0


def test_stream_damaged_gzip_is_damaged_not_empty():
    packed = gzip.compress(numbered(100_000))
    cut = read_stream_tail(io.BytesIO(packed[: len(packed) // 2]))
    assert cut.damaged and cut.text.startswith("line 1\n")
    garbage = read_stream_tail(io.BytesIO(b"\x1f\x8b" + b"\x00garbage" * 10))
    assert garbage.damaged and garbage.text == ""


def test_stream_memory_stays_bounded_for_plain_and_gzip():
    plain = (b"z" * 99 + b"\n") * (48 * 2**20 // 100)
    for data in (plain, gzip.compress(plain)):
        stream = io.BytesIO(data)
        tail, peak = peak_bytes(lambda: read_stream_tail(stream, max_bytes=2**20))
        assert tail.text.endswith("z" * 99 + "\n") and tail.size == len(plain)
        assert peak < 8 * 2**20


def test_read_head_plain_gzip_and_unreadable(tmp_path):
    assert read_head(write(tmp_path, "a.log", numbered(1000)), 14) == "line 1\nline 2\n"
    assert read_head(write(tmp_path, "a.log.gz", gzip.compress(numbered(100_000))), 14) == "line 1\nline 2\n"
    assert read_head(write(tmp_path, "bad.gz", b"\x1f\x8bgarbage")) == ""
    assert read_head(tmp_path / "nope.log") == ""
