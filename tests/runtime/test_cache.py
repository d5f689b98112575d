"""The engine cache: atomic publish under races and crashes, verified reads (garbage
collection: test_cache_gc.py)."""

import hashlib
import json
import multiprocessing
import os
import time

import pytest
from blake3 import blake3

from kiln.runtime.engine.cache import publish as publishing, verify
from kiln.runtime.engine.cache.entry import (CacheError, CacheIntegrityError, Manifest, entry_dir,
                                             lookup, relative_path)
from kiln.runtime.engine.cache.publish import remove_dead_temporaries
from kiln.runtime.engine.cache.verify import read_unverified, read_verified
from kiln.runtime.api import enginekey
from kiln.runtime.api.spec import runtime_with_defaults

NS, MODEL = "ml", "resnet"


def inputs(version="1", precision="fp32"):
    return enginekey.key_inputs({"uri": "pvc://models/r.onnx", "version": version},
                                {"backend": "onnxruntime", "precision": precision},
                                "cpu", "1.32.0")


def publish(root, engine=b"engine-bytes" * 1000, version="1", clock=time.time):
    ki = inputs(version)
    return publishing.publish(root, NS, MODEL, ki.key, engine, engine_file="engine.onnx",
                              inputs=ki.to_dict(), backend="onnxruntime", backend_version="1.32.0",
                              target="cpu", build_seconds=1.25, clock=clock)


def test_publish_then_lookup_and_read(tmp_path):
    engine = os.urandom(3 << 20)
    m = publish(tmp_path, engine)
    entry = entry_dir(tmp_path, NS, MODEL, m.key)
    assert sorted(p.name for p in entry.iterdir()) == ["engine.onnx", "manifest.json"]
    on_disk = json.loads((entry / "manifest.json").read_text())
    assert on_disk["sha256"] == m.sha256 and on_disk["sizeBytes"] == len(engine)
    assert on_disk["inputs"] == inputs().to_dict() and on_disk["backendVersion"] == "1.32.0"
    assert lookup(tmp_path, NS, MODEL, m.key) == m
    assert relative_path(NS, MODEL, m.key) == f"ml/resnet/{m.key}"
    data, manifest, timings = read_verified(entry, chunk_bytes=1 << 20)
    assert bytes(data) == engine and manifest == m
    assert timings.read_seconds >= 0 and timings.verify_seconds >= 0
    data2, _, _ = read_unverified(entry)
    assert bytes(data2) == engine


def test_manifest_round_trip_and_profiles():
    ki = enginekey.key_inputs(
        {"uri": "x", "version": "1"},
        {"backend": "tensorrt", "precision": "fp16",
         "profiles": [{"input": "x", "min": [1, 4], "opt": [8, 4], "max": [32, 4]}]},
        "sm90", "10.13")
    m = Manifest(key=ki.key, inputs=ki.to_dict(), engine_file="engine.plan", sha256="a" * 64,
                 size_bytes=10, backend="tensorrt", backend_version="10.13", target="sm90",
                 build_seconds=3.0, built_at="2026-01-01T00:00:00Z")
    assert Manifest.from_json(m.to_json()) == m
    profile = m.profiles()["x"]
    assert (profile.min, profile.opt, profile.max) == ((1, 4), (8, 4), (32, 4))
    with pytest.raises(CacheError, match="invalid manifest"):
        Manifest.from_json('{"key": "k"}')


def test_bad_names_are_refused(tmp_path):
    for bad in ("..", "a/b", ".tmp-x", ""):
        with pytest.raises(ValueError, match="invalid"):
            entry_dir(tmp_path, NS, bad, "k")
    with pytest.raises(ValueError, match="hash to"):
        publishing.publish(tmp_path, NS, MODEL, "0" * 20, b"x", engine_file="engine.onnx",
                           inputs=inputs().to_dict(), backend="onnxruntime", backend_version="1",
                           target="cpu", build_seconds=0)


def _racer(root, seed, barrier, results):
    barrier.wait()
    m = publish(root, engine=bytes([seed]) * (4 << 20))
    results.put(m.to_json())


def test_two_processes_publish_the_same_key(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(tmp_path, seed, barrier, results)) for seed in (1, 2)]
    for p in procs:
        p.start()
    seen = [Manifest.from_json(results.get(timeout=30)) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    # Both builders end with the one published entry (the winner's engine).
    assert seen[0] == seen[1]
    model_dir = tmp_path / NS / MODEL
    assert [p.name for p in model_dir.iterdir()] == [seen[0].key]
    data, manifest, _ = read_verified(model_dir / seen[0].key)
    assert manifest == seen[0] and len(set(bytes(data))) == 1


def test_publish_keeps_an_existing_entry(tmp_path):
    first = publish(tmp_path, b"first")
    second = publish(tmp_path, b"second")
    assert second == first
    data, _, _ = read_verified(entry_dir(tmp_path, NS, MODEL, first.key))
    assert bytes(data) == b"first"


def test_tampered_engine_is_refused_naming_file_and_digests(tmp_path):
    m = publish(tmp_path, os.urandom(1 << 20))
    entry = entry_dir(tmp_path, NS, MODEL, m.key)
    engine = entry / "engine.onnx"
    data = bytearray(engine.read_bytes())
    data[12345] ^= 0xFF
    engine.write_bytes(bytes(data))
    actual = blake3(data).hexdigest()  # one chunk: its digest is the file's
    with pytest.raises(CacheIntegrityError) as e:
        read_verified(entry)
    message = str(e.value)
    assert str(engine) in message and actual in message and m.chunk_digests[0] in message


def test_truncated_engine_is_refused_naming_file_and_sizes(tmp_path):
    m = publish(tmp_path, os.urandom(1 << 20))
    entry = entry_dir(tmp_path, NS, MODEL, m.key)
    engine = entry / "engine.onnx"
    engine.write_bytes(engine.read_bytes()[:1000])
    with pytest.raises(CacheIntegrityError) as e:
        read_verified(entry)
    assert str(engine) in str(e.value) and "1000 bytes" in str(e.value)
    assert f"{1 << 20} bytes" in str(e.value)
    with pytest.raises(CacheIntegrityError, match="size 1000 bytes"):
        lookup(tmp_path, NS, MODEL, m.key)


# -- chunk digests: verified on several threads ------------------------------------------

CHUNK = 64 << 10  # small chunks, so a multi-chunk engine stays small


def publish_chunked(root, engine, chunk_bytes=CHUNK):
    ki = inputs()
    m = publishing.publish(root, NS, MODEL, ki.key, engine, engine_file="engine.onnx",
                           inputs=ki.to_dict(), backend="onnxruntime", backend_version="1.32.0",
                           target="cpu", build_seconds=1.25, chunk_bytes=chunk_bytes)
    return m, entry_dir(root, NS, MODEL, m.key)


def test_publish_records_the_whole_digest_and_one_per_chunk(tmp_path):
    engine = os.urandom(5 * CHUNK + 123)  # the last chunk is short
    m, entry = publish_chunked(tmp_path, engine)
    on_disk = json.loads((entry / "manifest.json").read_text())
    assert on_disk["sha256"] == hashlib.sha256(engine).hexdigest()  # what sha256sum prints
    assert on_disk["chunkBytes"] == CHUNK
    assert on_disk["chunkBlake3"] == [blake3(engine[i:i + CHUNK]).hexdigest()  # what b3sum prints
                                      for i in range(0, len(engine), CHUNK)]
    assert len(on_disk["chunkBlake3"]) == 6 and "chunkSha256" not in on_disk
    assert Manifest.from_json(m.to_json()) == m
    assert (m.chunk_bytes, len(m.chunk_digests), m.chunk_hash) == (CHUNK, 6, "blake3")
    # The default is DIGEST_CHUNK_BYTES.
    default = publish(tmp_path / "d", os.urandom(1000))
    assert default.chunk_bytes == verify.DIGEST_CHUNK_BYTES and len(default.chunk_digests) == 1


@pytest.mark.parametrize("threads", [None, 1, 3, 8])
@pytest.mark.parametrize("size", [0, 1, CHUNK, 7 * CHUNK, 7 * CHUNK + 1])
def test_a_multi_chunk_engine_verifies(tmp_path, size, threads):
    engine = os.urandom(size)
    m, entry = publish_chunked(tmp_path, engine)
    for read_bytes in (verify.CHUNK_BYTES, CHUNK // 3, 3 * CHUNK + 5):  # reads across chunks
        data, manifest, timings = read_verified(entry, chunk_bytes=read_bytes,
                                                threads=threads)
        assert bytes(data) == engine and manifest == m
        assert timings.read_seconds >= 0 and timings.verify_seconds >= 0
    data, _, _ = read_verified(entry, whole_digest=True)
    assert bytes(data) == engine
    for threads in (1, 3):  # the benchmark's baselines: one read, the same parallel reads
        assert bytes(read_unverified(entry, threads=threads, chunk_bytes=CHUNK // 3)[0]) \
            == engine


@pytest.mark.parametrize("k", [0, 3, 6])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_flipped_byte_in_chunk_k_is_refused_naming_chunk_k(tmp_path, k, threads):
    engine = bytearray(os.urandom(6 * CHUNK + 1000))
    m, entry = publish_chunked(tmp_path, bytes(engine))
    offset = k * CHUNK + 777 if k < 6 else 6 * CHUNK + 999
    engine[offset] ^= 0x01
    (entry / "engine.onnx").write_bytes(engine)
    end = min(len(engine), (k + 1) * CHUNK) - 1
    actual = blake3(engine[k * CHUNK:end + 1]).hexdigest()
    with pytest.raises(CacheIntegrityError) as e:
        read_verified(entry, threads=threads, chunk_bytes=CHUNK // 2)
    message = str(e.value)
    assert f"{entry / 'engine.onnx'}: chunk {k} (bytes {k * CHUNK}-{end}, chunkBytes {CHUNK})" \
        in message
    assert f"blake3 {actual} does not match the manifest's chunkBlake3[{k}] " \
        f"{m.chunk_digests[k]}" in message
    # The whole-file check, as the build's load check asks for, refuses it too.
    with pytest.raises(CacheIntegrityError, match=f"chunk {k} "):
        read_verified(entry, whole_digest=True)


@pytest.mark.parametrize("change", ["truncated", "extended", "last-chunk-short"])
def test_a_truncated_or_extended_chunked_engine_is_refused(tmp_path, change):
    engine = os.urandom(4 * CHUNK)
    m, entry = publish_chunked(tmp_path, engine)
    path = entry / "engine.onnx"
    changed = {"truncated": engine[:3 * CHUNK], "extended": engine + b"\0",
               "last-chunk-short": engine[:-1]}[change]
    path.write_bytes(changed)
    for read in (read_verified, read_unverified):
        with pytest.raises(CacheIntegrityError) as e:
            read(entry)
        assert f"size {len(changed)} bytes, manifest expects {4 * CHUNK} bytes" in str(e.value)


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("change", ["grows", "shrinks"])
def test_a_file_that_changes_size_while_it_is_read_is_refused(tmp_path, monkeypatch, change, old):
    engine = os.urandom(3 * CHUNK)
    m, entry = publish_chunked(tmp_path, engine)
    if old:  # no chunk digests: the sequential read
        doc = json.loads((entry / "manifest.json").read_text())
        del doc["chunkBytes"], doc["chunkBlake3"]
        (entry / "manifest.json").write_text(json.dumps(doc))
    real_open = verify._open_published

    def then_change(e):
        opened = real_open(e)
        if change == "grows":
            with open(entry / "engine.onnx", "ab") as f:
                f.write(b"more")
        else:
            os.truncate(entry / "engine.onnx", 2 * CHUNK + 7)
        return opened

    monkeypatch.setattr(verify, "_open_published", then_change)
    got = 3 * CHUNK + 1 if change == "grows" else 2 * CHUNK + 7
    with pytest.raises(CacheIntegrityError,
                       match=f"read {got} bytes, manifest expects {3 * CHUNK} bytes "
                             r"\(the file changed while it was read\)"):
        read_verified(entry, threads=1)


@pytest.mark.parametrize("edit", ["one-missing", "one-extra", "chunk-size", "size", "empty"])
def test_a_chunk_list_that_does_not_cover_size_bytes_is_refused(tmp_path, edit):
    engine = os.urandom(4 * CHUNK + 10)  # 5 chunks
    m, entry = publish_chunked(tmp_path, engine)
    chunks = list(m.chunk_digests)
    if edit == "one-missing":
        _rewrite_manifest(entry, chunkBlake3=chunks[:-1])
        count, size, piece = 4, len(engine), CHUNK
    elif edit == "one-extra":
        _rewrite_manifest(entry, chunkBlake3=chunks + [chunks[0]])
        count, size, piece = 6, len(engine), CHUNK
    elif edit == "chunk-size":
        _rewrite_manifest(entry, chunkBytes=2 * CHUNK)
        count, size, piece = 5, len(engine), 2 * CHUNK
    elif edit == "size":  # the file cut to a whole number of chunks, and sizeBytes with it
        (entry / "engine.onnx").write_bytes(engine[:4 * CHUNK])
        _rewrite_manifest(entry, sizeBytes=4 * CHUNK)
        count, size, piece = 5, 4 * CHUNK, CHUNK
    else:
        _rewrite_manifest(entry, chunkBlake3=[])
        count, size, piece = 0, len(engine), CHUNK
    expected = (f"{entry / 'manifest.json'}: {count} chunk digests, but sizeBytes {size} in "
                f"chunks of {piece} bytes makes {-(-size // piece)}")
    for read in (read_verified, read_unverified):
        with pytest.raises(CacheIntegrityError) as e:
            read(entry)
        assert expected in str(e.value)
    with pytest.raises(CacheIntegrityError, match="the manifest is inconsistent"):
        lookup(tmp_path, NS, MODEL, m.key)


@pytest.mark.parametrize("fields", [{"chunkBytes": 0}, {"chunkBytes": -1}, {"chunkBytes": True},
                                    {"chunkBytes": "65536"}, {"chunkBlake3": "ab"},
                                    {"chunkBlake3": ["xyz"]}, {"chunkBlake3": None},
                                    {"chunkSha256": []}])  # the last: two digest lists
def test_malformed_chunk_fields_are_an_invalid_manifest(tmp_path, fields):
    m, entry = publish_chunked(tmp_path, os.urandom(2 * CHUNK))
    _rewrite_manifest(entry, **fields)
    with pytest.raises(CacheError, match="invalid manifest"):
        read_verified(entry)
    doc = json.loads(m.to_json())
    del doc["chunkBlake3"]  # one without the other
    with pytest.raises(CacheError, match="invalid manifest"):
        Manifest.from_json(json.dumps(doc))


def test_an_old_manifest_without_chunks_verifies_with_the_whole_digest(tmp_path):
    engine = bytearray(os.urandom(3 * CHUNK + 5))
    m, entry = publish_chunked(tmp_path, bytes(engine))
    doc = json.loads((entry / "manifest.json").read_text())
    del doc["chunkBytes"], doc["chunkBlake3"]  # as an entry published before chunk digests
    (entry / "manifest.json").write_text(json.dumps(doc))
    data, old, _ = read_verified(entry, chunk_bytes=CHUNK // 2)
    assert bytes(data) == engine and old.chunk_bytes == 0 and old.chunk_digests == ()
    assert "chunkBytes" not in old.to_json() and Manifest.from_json(old.to_json()) == old
    assert lookup(tmp_path, NS, MODEL, m.key) == old
    engine[2 * CHUNK + 1] ^= 0x80  # and corruption is still caught, by the whole digest
    (entry / "engine.onnx").write_bytes(engine)
    with pytest.raises(CacheIntegrityError) as e:
        read_verified(entry)
    assert (f"sha256 {hashlib.sha256(engine).hexdigest()} does not match the manifest's "
            f"{m.sha256}") in str(e.value)


def test_whole_digest_catches_a_manifest_pairing_chunks_with_another_sha256(tmp_path):
    engine = os.urandom(3 * CHUNK)
    m, entry = publish_chunked(tmp_path, engine)
    other = hashlib.sha256(b"another engine").hexdigest()
    _rewrite_manifest(entry, sha256=other)
    # Pods check the chunks (the manifest is not signed: whoever edits it can edit both);
    # the build's load check, and sha256sum, see the pairing is wrong.
    assert bytes(read_verified(entry)[0]) == engine
    with pytest.raises(CacheIntegrityError, match=f"does not match the manifest's {other}"):
        read_verified(entry, whole_digest=True)


# -- an entry is trusted only for what lies inside it -----------------------------------

def _rewrite_manifest(entry, **fields):
    path = entry / "manifest.json"
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


def _engine_outside(tmp_path, engine):
    """A copy of the engine outside the cache: size and digest match the manifest, so only
    confinement keeps it from being served."""
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(engine)
    return outside


def _untrusted(case, tmp_path, entry, engine):
    """Make `entry` untrusted in one way; return what the refusal must say."""
    if case == "dotdot":
        _engine_outside(tmp_path, engine)
        _rewrite_manifest(entry, engineFile="../../../../outside.onnx")
        return f"{entry / 'manifest.json'}: engineFile '../../../../outside.onnx' is not a plain file name"
    if case == "absolute":
        outside = _engine_outside(tmp_path, engine)
        _rewrite_manifest(entry, engineFile=str(outside))
        return f"engineFile '{outside}' is not a plain file name inside the entry"
    if case == "subdirectory":
        (entry / "sub").mkdir()
        (entry / "engine.onnx").rename(entry / "sub" / "engine.onnx")
        _rewrite_manifest(entry, engineFile="sub/engine.onnx")
        return "engineFile 'sub/engine.onnx' is not a plain file name"
    if case == "manifest-as-engine":
        _rewrite_manifest(entry, engineFile="manifest.json")
        return "engineFile 'manifest.json' is not a plain file name"
    if case == "symlink-outside":
        outside = _engine_outside(tmp_path, engine)
        (entry / "engine.onnx").unlink()
        (entry / "engine.onnx").symlink_to(outside)
        return f"{entry / 'engine.onnx'}: the engine file is a symbolic link"
    if case == "symlink-inside":
        (entry / "engine.onnx").rename(entry / "real.onnx")
        (entry / "engine.onnx").symlink_to("real.onnx")
        return f"{entry / 'engine.onnx'}: the engine file is a symbolic link"
    if case == "symlink-manifest":
        real = tmp_path / "manifest-elsewhere.json"
        (entry / "manifest.json").rename(real)
        (entry / "manifest.json").symlink_to(real)
        return f"{entry / 'manifest.json'}: the manifest is a symbolic link"
    if case == "symlink-entry":
        elsewhere = tmp_path / "elsewhere" / entry.name
        elsewhere.parent.mkdir()
        entry.rename(elsewhere)
        entry.symlink_to(elsewhere, target_is_directory=True)
        return f"{entry}: the entry is a symbolic link"
    if case == "fifo":
        # An empty engine, so that without the check the size matches and open() waits
        # for a writer that never comes.
        (entry / "engine.onnx").unlink()
        os.mkfifo(entry / "engine.onnx")
        _rewrite_manifest(entry, sizeBytes=0, sha256=hashlib.sha256(b"").hexdigest())
        return f"{entry / 'engine.onnx'}: the engine file is a FIFO, not a regular file"
    if case == "directory":
        (entry / "engine.onnx").unlink()
        (entry / "engine.onnx").mkdir()
        _rewrite_manifest(entry, sizeBytes=(entry / "engine.onnx").stat().st_size)
        return f"{entry / 'engine.onnx'}: the engine file is a directory, not a regular file"
    if case == "key-mismatch":
        other = entry.with_name(inputs("2").key)
        entry.rename(other)
        return f"names key {entry.name}, but the entry is {other.name}"
    raise AssertionError(case)


UNTRUSTED = ["dotdot", "absolute", "subdirectory", "manifest-as-engine", "symlink-outside",
             "symlink-inside", "symlink-manifest", "symlink-entry", "fifo", "directory",
             "key-mismatch"]


@pytest.mark.timeout(20)  # a FIFO that is opened blocks forever: the timeout makes that a failure
@pytest.mark.parametrize("case", UNTRUSTED)
def test_every_read_refuses_what_leaves_its_entry_or_is_not_a_regular_file(tmp_path, case):
    engine = os.urandom(64 << 10)
    m = publish(tmp_path / "cache", engine)
    entry = entry_dir(tmp_path / "cache", NS, MODEL, m.key)
    expected = _untrusted(case, tmp_path, entry, engine)
    if case == "key-mismatch":
        entry, key = entry.with_name(inputs("2").key), inputs("2").key
    else:
        key = m.key
    for read in (read_verified, read_unverified):
        with pytest.raises(CacheIntegrityError) as e:
            read(entry)
        assert expected in str(e.value)
    with pytest.raises(CacheIntegrityError) as e:
        lookup(tmp_path / "cache", NS, MODEL, key)
    assert expected in str(e.value)


# -- what a killed publish leaves behind ------------------------------------------------

def _temporary(root, key, held):
    """A temporary made the way publish makes it, with part of an engine; its lock stays
    held (a live writer) or is released as a killed writer's is."""
    parent = entry_dir(root, NS, MODEL, key).parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp, lock = publishing._locked_temporary(parent, key)
    (tmp / "engine.onnx").write_bytes(b"half an engine")
    if not held:
        os.close(lock)
    return tmp, lock


def test_the_next_publish_of_a_key_removes_its_dead_temporaries_only(tmp_path):
    key, other = inputs("1").key, inputs("2").key
    dead, _ = _temporary(tmp_path, key, held=False)
    live, lock = _temporary(tmp_path, key, held=True)
    others, _ = _temporary(tmp_path, other, held=False)
    unlocked = dead.with_name(f".tmp-{key}-nolock")  # no lock file: not known to be dead
    unlocked.mkdir()
    try:
        m = publish(tmp_path)
        assert m.key == key
        model_dir = tmp_path / NS / MODEL
        assert sorted(p.name for p in model_dir.iterdir()) == sorted(
            [key, live.name, others.name, unlocked.name])
        assert sorted(p.name for p in (model_dir / key).iterdir()) == ["engine.onnx", "manifest.json"]
    finally:
        os.close(lock)
    # Its writer gone, the live one is debris too.
    assert remove_dead_temporaries(tmp_path, NS, MODEL, key) == [live]
    assert others.exists() and unlocked.exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", [None, *UNTRUSTED])
async def test_a_served_model_stays_not_ready_with_the_refusal(tmp_path, case, matmul_onnx):
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.model import FAILED, READY, ServedModel

    root = tmp_path / "cache"
    m = publish(root, matmul_onnx)
    entry = entry_dir(root, NS, MODEL, m.key)
    expected = _untrusted(case, tmp_path, entry, matmul_onnx) if case else None
    key = inputs("2").key if case == "key-mismatch" else m.key
    model = ServedModel(MODEL, "1", root, {"cpu": relative_path(NS, MODEL, key)},
                        runtime_with_defaults({"batching": {"maxBatchSize": 4}}), ServerMetrics(), target="cpu")
    try:
        loaded = await model.load()
        if case is None:  # the sound entry, as published, serves
            assert loaded and model.state == READY and model.ready
            return
        assert not loaded and model.state == FAILED and not model.ready
        assert expected in model.error and expected in model.status_message()
        assert model.engine is None
    finally:
        await model.close(0)


@pytest.mark.parametrize("threads", [1, 4])
def test_an_entry_with_sha256_chunk_digests_still_verifies(tmp_path, threads):
    """Published before BLAKE3 chunk digests: chunkSha256, checked as before."""
    engine = bytearray(os.urandom(3 * CHUNK + 5))
    m, entry = publish_chunked(tmp_path, bytes(engine))
    sha = [hashlib.sha256(engine[i:i + CHUNK]).hexdigest() for i in range(0, len(engine), CHUNK)]
    doc = json.loads((entry / "manifest.json").read_text())
    del doc["chunkBlake3"]
    doc["chunkSha256"] = sha
    (entry / "manifest.json").write_text(json.dumps(doc))
    data, old, _ = read_verified(entry, threads=threads)
    assert bytes(data) == engine and (old.chunk_hash, old.chunk_digests) == ("sha256", tuple(sha))
    assert json.loads(old.to_json())["chunkSha256"] == sha
    engine[CHUNK + 3] ^= 0x01
    (entry / "engine.onnx").write_bytes(engine)
    with pytest.raises(CacheIntegrityError, match=r"chunk 1 .*: sha256 \w+ does not match "
                                                        r"the manifest's chunkSha256\[1\]"):
        read_verified(entry, threads=threads)
