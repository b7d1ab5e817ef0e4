"""The client refuses clearly when the daemon does not serve what it expects (the daemon's
serving loop runs in this process, beside the client)."""

import json

import pytest
from harness import SMALL_CACHE_GB, InProcessDaemon

from expertd.client import load
from expertd.errors import DaemonError


def test_load_refuses_a_daemon_serving_another_version_of_the_directory(blob_dir, isolated_env):
    blobs = blob_dir
    with InProcessDaemon(blobs, "--cache-gb", SMALL_CACHE_GB):
        # Same content, written differently: another conversion as far as the client can tell.
        manifest = blobs / "manifest.json"
        manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=3))
        with pytest.raises(DaemonError, match="another version") as err:
            load(blobs)
        assert "expertd stop --blobs" in str(err.value)


def test_load_works_with_the_directory_the_daemon_serves(blobs, isolated_env):
    with InProcessDaemon(blobs, "--cache-gb", SMALL_CACHE_GB):
        model, _ = load(blobs)
        assert model.expertd_session.session.hello["manifest"] == model.expertd_session.manifest.digest
        model.expertd_session.close()
