"""model_loader/config_snapshot.py: a saved config reads back every attribute the
transformers config had, and is rebuilt when its file or the code deriving it changes."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoConfig

from pagedserve.config import ModelConfig
from pagedserve.model_loader import load_model_config
from pagedserve.model_loader.config_snapshot import ConfigSnapshot, cached_config, snapshot_values
from tests.e2e.conftest import make_tiny_checkpoint
from tests.model_loader.test_loader import write_gguf
from tests.models.models_helpers import make_hf_model


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def assert_same_attributes(snap: ConfigSnapshot, real) -> None:
    """Every public attribute of the real config: the same value and type on the snapshot,
    or, where its value could not be saved, a LookupError rather than a quiet default."""
    _, unsaved = snapshot_values(real)
    for name in dir(real):
        if name.startswith("_"):
            continue
        try:
            want = getattr(real, name)
        except Exception:  # noqa: BLE001 - not applicable to this config on the real one either
            continue
        if callable(want):
            continue
        if name in unsaved:
            with pytest.raises(LookupError, match=name):
                getattr(snap, name)
            continue
        got = getattr(snap, name)
        if isinstance(got, ConfigSnapshot):
            assert_same_attributes(got, want)
        else:
            assert type(got) is type(want) and got == want, name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma3", "mistral"])
def test_a_saved_config_reads_back_every_attribute(tmp_path, arch: str) -> None:
    path = str(tmp_path / arch)
    make_tiny_checkpoint(arch, path)
    config_json = os.path.join(path, "config.json")
    built: list[object] = []

    def build():
        built.append(AutoConfig.from_pretrained(path))
        return built[-1]

    first = cached_config(config_json, build)  # the first start builds it with transformers
    again = cached_config(config_json, lambda: pytest.fail("the saved config should be read"))
    assert len(built) == 1 and isinstance(first, ConfigSnapshot) and isinstance(again, ConfigSnapshot)
    assert_same_attributes(first, built[0])
    assert_same_attributes(again, built[0])
    assert getattr(again, "no_such_field", "default") == "default"


def test_a_gguf_file_is_read_by_its_saved_config_the_second_time(tmp_path) -> None:
    hf = make_hf_model("llama")
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, "llama")
    from pagedserve.model_loader.gguf_utils import gguf_to_hf_config, open_gguf

    first = load_model_config(ModelConfig(model=path, dtype="float32"), "cpu")
    again = load_model_config(ModelConfig(model=path, dtype="float32"), "cpu")
    assert isinstance(first, ConfigSnapshot) and isinstance(again, ConfigSnapshot)
    assert os.listdir(os.path.join(os.environ["PAGEDSERVE_CACHE_DIR"], "configs"))  # saved by the first
    assert_same_attributes(again, gguf_to_hf_config(open_gguf(path), path))


def test_a_changed_file_or_a_torn_save_builds_it_again(tmp_path, caplog) -> None:
    path = str(tmp_path / "m")
    make_tiny_checkpoint("llama", path)
    config_json = os.path.join(path, "config.json")
    cached_config(config_json, lambda: AutoConfig.from_pretrained(path))
    with open(config_json) as f:
        values = json.load(f)
    values["rms_norm_eps"] = 1e-3
    before = os.stat(config_json)
    with open(config_json, "w") as f:
        json.dump(values, f)
    os.utime(config_json, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # whatever the clock's grain
    rebuilt: list[str] = []

    def build():
        rebuilt.append(config_json)
        return AutoConfig.from_pretrained(path)

    assert cached_config(config_json, build).rms_norm_eps == 1e-3 and rebuilt
    saved_dir = os.path.join(os.environ["PAGEDSERVE_CACHE_DIR"], "configs")
    for name in os.listdir(saved_dir):
        with open(os.path.join(saved_dir, name), "w") as f:
            f.write("{torn")
    rebuilt.clear()
    assert cached_config(config_json, build).rms_norm_eps == 1e-3 and rebuilt
    assert "cannot read the saved model config" in caplog.text
    assert cached_config(config_json, lambda: pytest.fail("saved again")).rms_norm_eps == 1e-3


def test_a_copied_directory_reads_the_saved_config_under_its_own_name(tmp_path, monkeypatch) -> None:
    """A directory's config.json is keyed by its bytes: a copy elsewhere (a moved model,
    each test's fresh directory) reads the snapshot without building a transformers config
    and names its own directory; one changed byte builds it again."""
    import shutil

    from pagedserve.model_loader import loader

    first_dir, copy_dir = str(tmp_path / "a"), str(tmp_path / "b")
    make_tiny_checkpoint("llama", first_dir)
    shutil.copytree(first_dir, copy_dir)
    first = load_model_config(ModelConfig(model=first_dir, dtype="float32"), "cpu")
    real_auto_config = loader._auto_config
    monkeypatch.setattr(loader, "_auto_config", lambda *a: pytest.fail("the copy should read the saved config"))
    copy = load_model_config(ModelConfig(model=copy_dir, dtype="float32"), "cpu")
    assert isinstance(copy, ConfigSnapshot)
    assert (first.name_or_path, copy.name_or_path) == (first_dir, copy_dir)
    assert_same_attributes(copy, AutoConfig.from_pretrained(copy_dir))
    saved_dir = os.path.join(os.environ["PAGEDSERVE_CACHE_DIR"], "configs")
    assert len(os.listdir(saved_dir)) == 1

    config_json = os.path.join(copy_dir, "config.json")
    with open(config_json) as f:
        values = json.load(f)
    values["rms_norm_eps"] = 1e-3
    with open(config_json, "w") as f:
        json.dump(values, f)
    built: list[str] = []
    monkeypatch.setattr(loader, "_auto_config", lambda *a: built.append(a[0]) or real_auto_config(*a))
    assert load_model_config(ModelConfig(model=copy_dir, dtype="float32"), "cpu").rms_norm_eps == 1e-3
    assert built == [copy_dir] and len(os.listdir(saved_dir)) == 2
