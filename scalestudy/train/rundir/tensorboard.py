"""TensorBoard scalar event files, written without importing TensorFlow (seconds per process
saved): the Event protobuf encoded by hand in TFRecord framing (length, masked CRC-32C)."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, summary: bytes = b"", version: str = "") -> bytes:
    """A serialized tensorflow.Event (wall_time=1, step=2, file_version=3, summary=5)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        out += _field(3, version.encode())
    if summary:
        out += _field(5, summary)
    return out


class EventWriter:
    """TensorBoard scalar events (Summary.Value.simple_value) in TFRecord framing, written
    without importing TensorFlow (seconds per process saved)."""

    def __init__(self, logdir: Path, suffix: str = ""):
        """A new event file in `logdir`; `suffix` ends its name (as TensorFlow's
        `filename_suffix`), so that two writers of one process and second never share one."""
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        name += f".{suffix}" if suffix else ""
        self._file = (logdir / name).open("ab")
        self._record(_event(0, time.time(), version="brain.Event:2"))

    def _record(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(length + struct.pack("<I", _masked_crc32c(length)))
        self._file.write(data + struct.pack("<I", _masked_crc32c(data)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in values.items()
        )
        self._record(_event(step, time.time(), summary))

    def close(self) -> None:
        self._file.close()
