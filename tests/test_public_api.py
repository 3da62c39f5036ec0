"""``import tether``: the stable surface, loaded lazily; and the old import paths of moved modules,
which still work with a DeprecationWarning until tether 0.2."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import tether
from tether.common import moved


def test_import_tether_loads_neither_torch_nor_grpc() -> None:
    code = "import sys, tether; print(sorted(m for m in ('torch', 'grpc', 'numba') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", tether.__all__)
def test_each_public_name_is_its_modules_own(name: str) -> None:
    value = getattr(tether, name)
    assert value is getattr(importlib.import_module(tether._HOMES[name]), name)
    assert name in dir(tether)


def test_the_surface_names_what_a_training_script_needs() -> None:
    assert set(tether.__all__) == set(tether._HOMES)
    assert {"Trainer", "TrainingConfig", "ShardedEmbeddingBag", "ParquetStream", "PSClient", "load_export", "TetherError",
            "UsageError"} <= set(tether.__all__)
    assert issubclass(tether.Unavailable, tether.TetherError)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="'Trainr'"):
        tether.Trainr  # noqa: B018


@pytest.mark.parametrize("old", sorted(set(moved.MOVED) - moved._NOW_PACKAGES))
def test_an_old_module_path_is_the_new_module_with_a_warning(old: str) -> None:
    sys.modules.pop(old, None)
    moved._warned.discard(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {moved.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(moved.MOVED[old])


@pytest.mark.parametrize(("old", "name"), [("tether.worker.training", "Trainer"), ("tether.worker.client", "PSClient"),
                                           ("tether.worker.data", "SyntheticClickLog")])
def test_an_old_modules_names_are_forwarded_by_the_package_now_there(old: str, name: str) -> None:
    moved._warned.discard(f"{old}.{name}")
    package = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {moved.MOVED[old]}\.{name}"):
        value = getattr(package, name)
    assert value is getattr(importlib.import_module(moved.MOVED[old]), name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        package.NoSuchName  # noqa: B018


def test_the_new_paths_import_without_a_warning() -> None:
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from tether import Trainer, ShardedEmbeddingBag\n"
            "from tether.worker.training.trainer import Trainer as T\n"
            "from tether.rules.optimizers import rule\n"
            "from tether.deploy.launch import LocalCluster\n"
            "assert T is Trainer\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("tether.worker.training.step")


@pytest.mark.parametrize(("module", "name", "home"), [
    ("tether.worker.training", "TrainingConfig", "tether.worker.config"),  # the old module tether.worker.training's
    ("tether.worker.embedding", "ShardedEmbeddingBag", "tether.worker.training.embedding_bag"),  # the old module's
    ("tether.protos.optimizers", "OptimizerConfig", "tether.protos.specs"),  # the old module's, now tether.rules.optimizers
    ("tether.protos.optimizers", "Adagrad", "tether.rules.update_rules"),
    # Each name the module now there gives from its home.
    *[(new, name, home) for new, names in sorted(moved.RE_EXPORTED.items()) for name, home in sorted(names.items())],
])
def test_a_name_an_old_module_re_exported_comes_from_its_home_with_a_warning(module: str, name: str, home: str) -> None:
    """The modules that replaced ``tether.worker.training`` and ``tether.worker.embedding``, the
    rules' registry and the local launcher hold no name of another module's: what they re-exported
    is given from its home, warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the old module path's own warning
        where = importlib.import_module(module)
    for key in [k for k in moved._warned if k.endswith(f".{name}")]:
        moved._warned.discard(key)
    with pytest.warns(DeprecationWarning, match=rf"\.{name} moved to {home}\.{name}"):
        value = getattr(where, name)
    assert value is getattr(importlib.import_module(home), name)
    for new in moved.RE_EXPORTED:
        assert name not in vars(importlib.import_module(new)) or name not in moved.RE_EXPORTED[new], (new, name)


def test_a_module_of_a_package_with_an_old_name_imports_first_and_alone() -> None:
    """``tether.worker.training.embedding`` imported first in a process (its own import of the
    ``embedding_bag`` submodule must not load the old module ``tether.worker.training`` forwards to)."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import tether.worker.training.embedding as e\n"
            "from tether.worker.training import embedding_bag\n"
            "assert 'ShardedEmbeddingBag' not in vars(e) and embedding_bag.ShardedEmbeddingBag\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
