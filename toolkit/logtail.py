"""Read the end of a log file, plain or gzip, in bounded time and memory.

A failed job's cause is at the end of its log, and logs can be many GB. ``read_tail``
returns at most ``max_bytes`` bytes of text from the end of a file:

- plain files: one ``seek`` to the last ``max_bytes`` and one read, so a 2 GB log costs the
  same as a small one;
- gzip files (recognised by their magic bytes, not their name): a gzip stream cannot be
  entered in the middle, so it is decompressed once from the start, keeping only a ring buffer
  of the last ``max_bytes`` decompressed bytes (memory stays below ``2 * max_bytes`` plus one
  chunk, whatever the ratio; concatenated members are followed). Because every byte passes
  through, the line number of the tail's first line is known for gzip;
- a damaged or truncated gzip gives what could be decompressed, flagged ``damaged``;
- bytes that are not UTF-8 (binary garbage, NULs of a sparse file) are decoded with
  ``errors="replace"``: text, never an exception.

When the tail starts inside the file, its first (partial) line is dropped so the text starts
at a line boundary, unless that line is all there is (one line over ``max_bytes`` ending in the
error, then a newline): then the partial line is kept, never an empty tail. Only regular files
are opened (``open_regular``: a FIFO or device never blocks the reader). A file that cannot be
opened or read raises ``LogError``.

``read_stream_tail`` does the same for a stream that cannot seek (a log pasted on standard input):
it reads it once in ``_READ_CHUNK`` pieces through the same ring buffer (and, for gzip, the same
bounded decompressor), so memory stays below ``2 * max_bytes`` plus a chunk whatever the input's
size, and nothing is written to disk. ``read_head`` gives the first bytes of a log (plain or gzip)
as text, for the job id a log names in its first lines.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from .errors import HpcmemError

DEFAULT_MAX_BYTES = 8 * 2**20
"""Bytes of the end of a log that are read by default (8 MiB)."""

_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 2**20  # compressed bytes read per call
_COUNT_CHUNK = 8 * 2**20  # bytes read per step when counting the lines of a skipped head
_OUT_CHUNK = 2**20  # most decompressed bytes produced per call (guards against gzip bombs)


class LogError(HpcmemError):
    """A log file is missing or cannot be read."""


@dataclass(frozen=True)
class Tail:
    """The end of a log.

    Unpacks as ``text, first_line, truncated = read_tail(path)``.
    """

    text: str
    """Decoded text (invalid UTF-8 replaced by U+FFFD), starting at a line boundary."""
    first_line: int | None
    """1-based line number in the whole log of the first line of ``text``; None when unknown
    (the head of a plain file was skipped)."""
    truncated: bool
    """True when ``text`` is not the whole log: its head was skipped or (gzip) its end is missing."""
    damaged: bool = False
    """True when a gzip stream ended early or was corrupt; ``text`` holds what could be decompressed."""
    size: int | None = field(default=None, compare=False)
    """Bytes of the whole log (decompressed) when every byte was read (gzip, streams); else None."""
    head: str | None = field(default=None, compare=False)
    """The log's first ``head_bytes`` as text, when ``read_stream_tail`` was asked for them; else None."""

    def __iter__(self) -> Iterator:
        return iter((self.text, self.first_line, self.truncated))


def read_tail(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, number_lines: bool = False) -> Tail:
    """Return at most the last ``max_bytes`` bytes (decompressed, for gzip) of ``path`` as text.

    ``number_lines``: when the head of a plain file is skipped, count its newlines (one streaming
    pass, no memory held) so ``first_line`` is known; gzip tails always know it. Raises ``LogError`` with a one-line message when the file is missing or unreadable.
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    try:
        with open_regular(path) as f:
            if f.read(2) == _GZIP_MAGIC:
                f.seek(0)
                return _ring_tail(_gunzip_chunks(_chunks(f)), max_bytes)
            return _plain_tail(f, max_bytes, number_lines)
    except NotRegularFile as e:
        raise LogError(f"cannot read log {os.fspath(path)!r}: not a regular file (a FIFO, socket or device)") from e
    except OSError as e:
        raise LogError(f"cannot read log {os.fspath(path)!r}: {e.strerror or e}") from e


class NotRegularFile(OSError):
    """``open_regular`` was given a FIFO, socket, device or directory."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open a regular file for binary reading without ever blocking: the open itself is non-blocking (a FIFO
    with no writer would wait for ever), and anything but a regular file raises ``NotRegularFile`` before a
    byte is read. Logs, job scripts and configs named by untrusted input go through here."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{os.fspath(path)}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_stream_tail(stream: BinaryIO, max_bytes: int = DEFAULT_MAX_BYTES, head_bytes: int = 0) -> Tail:
    """The last ``max_bytes`` bytes (decompressed, for gzip: by magic) of a binary stream read to its end.

    For standard input: one pass in bounded chunks, memory below ``2 * max_bytes`` plus a chunk,
    ``first_line`` and ``size`` always known, a damaged gzip flagged ``damaged``; ``head_bytes``: keep
    that many bytes of the start too, as ``Tail.head`` (a log names its job in its first line). Raises
    ``LogError`` when the stream cannot be read.
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    try:
        chunks = _chunks(stream)
        first = next(chunks, b"")
        while len(first) < 2:  # a pipe may hand over a single byte first
            more = next(chunks, b"")
            if not more:
                break
            first += more
        everything = _prepend(first, chunks)
        if first[:2] == _GZIP_MAGIC:
            return _ring_tail(_gunzip_chunks(everything), max_bytes, head_bytes)
        return _ring_tail(everything, max_bytes, head_bytes)
    except OSError as e:
        raise LogError(f"cannot read standard input: {e.strerror or e}") from e


def read_head(path: str | os.PathLike, max_bytes: int = 65536) -> str:
    """The first ``max_bytes`` bytes (decompressed, for gzip) of a log as text; "" when it cannot be read
    or a gzip is damaged at its very start. Never raises."""
    out = bytearray()
    try:
        with open_regular(path) as f:
            if f.read(2) != _GZIP_MAGIC:
                f.seek(0)
                return _decode(f.read(max_bytes))
            f.seek(0)
            for piece in _gunzip_chunks(_chunks(f, min(_READ_CHUNK, max_bytes))):
                if piece is None:
                    break
                out += piece
                if len(out) >= max_bytes:
                    break
    except OSError:
        return ""
    return _decode(bytes(out[:max_bytes]))


def _chunks(f, size: int = _READ_CHUNK) -> Iterator[bytes]:
    """The bytes of ``f`` in reads of at most ``size``."""
    while True:
        chunk = f.read(size)
        if not chunk:
            return
        yield chunk


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _plain_tail(f, max_bytes: int, number_lines: bool = False) -> Tail:
    """Tail of an uncompressed file: one seek, one read of at most ``max_bytes + 1`` bytes."""
    size = os.fstat(f.fileno()).st_size
    if size <= max_bytes:
        f.seek(0)
        return Tail(_decode(f.read(max_bytes)), 1, False)
    # One byte more than asked: if it is a newline, the tail starts on a whole line.
    f.seek(size - max_bytes - 1)
    data = f.read(max_bytes + 1)
    tail = _from_line_start(data)
    first_line = None
    if number_lines:
        first_line = _newlines_before(f, size - len(tail)) + 1
    return Tail(_decode(tail), first_line, True)


def _newlines_before(f, end: int) -> int:
    """Newlines in the first ``end`` bytes of ``f``, read in chunks."""
    f.seek(0)
    count, left = 0, end
    while left > 0:
        chunk = f.read(min(_COUNT_CHUNK, left))
        if not chunk:
            break
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def _from_line_start(data: bytes) -> bytes:
    """Drop everything up to and including the first newline (the partial first line).

    ``data[0]`` is the byte before the wanted tail. Text without any newline is kept whole, less
    the UTF-8 continuation bytes of a character cut in two.
    """
    cut = data.find(b"\n")
    if cut >= 0 and data[cut + 1 :].strip():
        return data[cut + 1 :]
    # no newline, or only the last line's own newline: that one (partial) line is the tail, never nothing
    start = 1
    while start < min(len(data), 4) and 0x80 <= data[start] < 0xC0:
        start += 1
    return data[start:]


def _ring_tail(pieces: Iterator[bytes | None], max_bytes: int, head_bytes: int = 0) -> Tail:
    """Tail of a sequence of byte pieces read once (a gzip's decompressed output, a stream), the last of
    them kept (about ``max_bytes`` plus one piece); a None piece means the input is damaged (what came before is kept).
    ``head_bytes``: the first bytes are kept too (``Tail.head``)."""
    kept: deque[bytes] = deque()  # the last pieces: at most max_bytes plus one piece
    kept_bytes = 0
    head = bytearray()
    dropped_lines = 0  # newlines in the pieces dropped from the front
    dropped_any = False
    last_dropped = b"\n"  # the byte just before the kept pieces
    damaged = False
    size = 0
    for out in pieces:
        if out is None:
            damaged = True
            break
        if not out:
            continue
        size += len(out)
        if len(head) < head_bytes:
            head += out[: head_bytes - len(head)]
        kept.append(out)
        kept_bytes += len(out)
        while kept_bytes - len(kept[0]) >= max_bytes:  # whole pieces only: each byte is counted once
            first = kept.popleft()
            kept_bytes -= len(first)
            dropped_lines += first.count(b"\n")
            last_dropped = first[-1:]
            dropped_any = True
    buf = bytearray().join(kept)
    kept.clear()
    if len(buf) > max_bytes:
        cut = len(buf) - max_bytes
        dropped_lines += buf.count(b"\n", 0, cut)
        last_dropped = bytes(buf[cut - 1 : cut])
        dropped_any = True
        del buf[:cut]
    if dropped_any and last_dropped != b"\n":
        nl = buf.find(b"\n")
        if nl >= 0 and buf[nl + 1 :].strip():  # keep a partial last line rather than return nothing
            del buf[: nl + 1]
            dropped_lines += 1
        else:  # the partial line is kept: less the UTF-8 continuation bytes of a character cut in two
            start = 0
            while start < min(len(buf), 3) and 0x80 <= buf[start] < 0xC0:
                start += 1
            del buf[:start]
    return Tail(_decode(buf), dropped_lines + 1, dropped_any or damaged, damaged, size,
                _decode(bytes(head)) if head_bytes else None)


def _gunzip_chunks(chunks: Iterator[bytes]) -> Iterator[bytes | None]:
    """Decompress gzip ``chunks``: yield pieces of at most ``_OUT_CHUNK`` bytes; yield None when damaged.

    Follows concatenated gzip members; trailing NUL padding is ignored.
    """
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    pending = b""
    for chunk in chunks:
        data = pending + chunk
        pending = b""
        while data:
            if d.eof:  # a member ended: another member, padding, or garbage follows
                if len(data) < 2:
                    pending = data
                    break
                if data[:2] != _GZIP_MAGIC:
                    if data.strip(b"\0"):
                        yield None
                        return
                    break
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out = d.decompress(data, _OUT_CHUNK)
            except zlib.error:
                yield None
                return
            if out:
                yield out
            data = d.unused_data if d.eof else d.unconsumed_tail
    while not d.eof:  # output zlib still holds after the last input (max_length cut it off)
        try:
            out = d.decompress(b"", _OUT_CHUNK)
        except zlib.error:
            break
        if not out:
            break
        yield out
    if not d.eof or pending.strip(b"\0"):
        yield None  # the stream stopped inside a member: a truncated file


def _decode(data: bytes | bytearray) -> str:
    """UTF-8 with replacement characters: binary garbage becomes text, never an error."""
    return data.decode("utf-8", errors="replace")
