"""The same-host path of a transfer (cpllm/disagg/shm_rows.py): a producer's rows written into one /dev/shm file,
read in place by the consumer and removed; a file nobody read removed at its expiry and at close; names not of
this transfer refused; the host key alike in two processes of this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cpllm.disagg import shm_rows
from cpllm.disagg.config import kv_transfer_config

pytestmark = pytest.mark.skipif(shm_rows.host_key() is None, reason="no /dev/shm on this machine")


def _files() -> set[str]:
    return {name for name in os.listdir(shm_rows.SHM_DIR) if name.startswith(shm_rows.PREFIX)}


def test_rows_round_trip_and_the_file_goes():
    writer, frames = shm_rows.ShmWriter(expiry_s=60), [b"abc", memoryview(bytearray(range(200))), b""]
    name = writer.write(frames)
    assert name in _files()
    with shm_rows.mapped_frames(name, [3, 200, 0]) as mapped:
        assert [bytes(m) for m in mapped] == [b"abc", bytes(range(200)), b""]
    assert name not in _files()
    writer.close()


def test_unread_files_go_at_expiry_and_at_close():
    writer = shm_rows.ShmWriter(expiry_s=0.05)
    stale = writer.write([b"x" * 10])
    time.sleep(0.1)
    fresh = writer.write([b"y"])  # each write sweeps what expired first
    assert stale not in _files() and fresh in _files()
    writer.close()
    assert fresh not in _files()


def test_foreign_names_refused():
    for name in ("passwd", "../etc/passwd", f"{shm_rows.PREFIX}../x"):
        with pytest.raises(ValueError, match="not a name this transfer writes"):
            with shm_rows.mapped_frames(name, [1]):
                pass


def test_host_key_alike_in_another_process():
    other = subprocess.run([sys.executable, "-c", "from cpllm.disagg.shm_rows import host_key; print(host_key())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == shm_rows.host_key()


def test_shared_memory_option():
    base = {"kv_connector": "CpllmConnector", "kv_role": "kv_consumer"}
    assert kv_transfer_config(base).shared_memory is True
    assert kv_transfer_config({**base, "kv_connector_extra_config": {"shared_memory": False}}).shared_memory is False
    with pytest.raises(ValueError, match="shared_memory='no' must be true or false"):
        kv_transfer_config({**base, "kv_connector_extra_config": {"shared_memory": "no"}})
