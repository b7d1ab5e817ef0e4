"""The client refuses clearly when the daemon does not serve what it expects."""

import json
import shutil

import pytest
from harness import SMALL_CACHE_GB, running_daemon

from expertd.client import load
from expertd.errors import DaemonError


def test_load_refuses_a_daemon_serving_another_version_of_the_directory(models, isolated_env,
                                                                        tmp_path):
    blobs = tmp_path / "blobs"
    shutil.copytree(models.blobs(), blobs)
    with running_daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        # Same content, written differently: another conversion as far as the client can tell.
        manifest = blobs / "manifest.json"
        manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=3))
        with pytest.raises(DaemonError, match="another version") as err:
            load(blobs)
        assert "expertd stop --blobs" in str(err.value)


def test_load_works_with_the_directory_the_daemon_serves(models, isolated_env):
    blobs = models.blobs()
    with running_daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        model, _ = load(blobs)
        assert model.expertd_session.hello["manifest"] == model.expertd_session.manifest.digest
        model.expertd_session.close()
