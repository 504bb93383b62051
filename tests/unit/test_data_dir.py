"""The sidecar's data dir: checked in words before anything is created, and the start-up load's
progress lines (sidecar_cuda.storage.sqlite)."""

from __future__ import annotations

import logging
import os
import pwd

import numpy as np
import pytest

from kalos.broker.errors import ConfigError
from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.select import choose_backend
from kalos.sidecar_cuda.storage.durable import resolve_writes
from kalos.sidecar_cuda.storage.sqlite import Persistence, prepare_data_dir
from kalos.sidecar_cuda.storage.store import MemoryStore
from kalos.sidecar_cuda.storage.writes import Write, WriteOp

pytestmark = pytest.mark.timeout(30)


def test_a_missing_data_dir_is_created_private(tmp_path) -> None:
    d = tmp_path / "a" / "b"
    prepare_data_dir(str(d))
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700


def test_a_file_in_place_of_the_data_dir_is_said_in_words(tmp_path) -> None:
    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(ConfigError) as exc:
        prepare_data_dir(str(f))
    assert str(exc.value).startswith(f"data dir {f} exists and is not a directory")
    assert f.read_text() == "mine"
    with pytest.raises(ConfigError, match=r"cannot create data dir .*afile/sub: Not a directory"):
        prepare_data_dir(str(f / "sub"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chowning a dir to another user needs root")
def test_a_data_dir_of_another_user_names_both_users(tmp_path) -> None:
    nobody = pwd.getpwnam("nobody")
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(ConfigError) as exc:
        prepare_data_dir(str(d))
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert str(exc.value) == (
        f"data dir {d} is owned by uid {nobody.pw_uid} (nobody) but the sidecar "
        f"runs as uid {os.geteuid()} ({me}); chown it or pick another dir"
    )
    assert (d.stat().st_mode & 0o777) == 0o700 and d.stat().st_uid == nobody.pw_uid  # untouched
    with pytest.raises(ConfigError, match="owned by uid"):
        Persistence(str(d), 8, "dot")
    assert os.listdir(d) == []  # no store file made in it


def test_start_up_load_reports_progress(tmp_path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture) -> None:
    p = Persistence(str(tmp_path), 8, "dot")
    vecs = rng.standard_normal((250, 8), dtype=np.float32)
    writes = [
        Write(WriteOp.UPSERT, "a", np.arange(250, dtype=np.int64), vecs, None),
        Write(WriteOp.UPSERT, "b", np.arange(50, dtype=np.int64), vecs[:50], None),
    ]
    resolve_writes(writes, None)
    p.commit(writes)
    p.close()
    p = Persistence(str(tmp_path), 8, "dot")
    store = MemoryStore(choose_backend("numpy"), 8, Metric.DOT)
    with caplog.at_level(logging.INFO, logger="kalos.sidecar"):
        rows, _secs = p.load_into(store, every_s=0.0, chunk=100)
    p.close()
    assert rows == 300 and store.counts() == {"a": 250, "b": 50}
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"loading 300 rows in 2 namespaces from {p.path}"
    assert lines[1:] == [
        "loading: 100 of 300 rows (33%), namespace 'a'",
        "loading: 200 of 300 rows (67%), namespace 'a'",
        "loading: 250 of 300 rows (83%), namespace 'a'",
        "loading: 300 of 300 rows (100%), namespace 'b'",
    ]
    np.testing.assert_array_equal(store.get("a").get(np.arange(250))[1], vecs)  # type: ignore[union-attr]
