"""Puts the activation files (``torch_threadsafe_compile.pth`` and the PEP 829 ``.start`` entry) at the root
of site-packages, for a normal wheel *and* for ``pip install -e .``.

* wheel: ``build_py`` copies them into the build directory's root, which becomes the wheel's root.
* editable (setuptools >= 64, PEP 660): ``editable_wheel`` ignores the build directory's root, so the files
  are added to the editable wheel's unpacked tree (the same place setuptools puts its own ``.pth``).
  If a future setuptools drops that hook, installation still succeeds and ``doctor`` reports that
  start-up activation is missing.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ACTIVATION_FILES = ("torch_threadsafe_compile.pth", "torch_threadsafe_compile.start")


def _copy_activation_files(dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for name in ACTIVATION_FILES:
        shutil.copyfile(os.path.join(HERE, "sitecustomize", name), os.path.join(dest, name))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        _copy_activation_files(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in ACTIVATION_FILES]


cmdclass = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: legacy develop mode; doctor will report missing activation
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_install_namespaces"):

    class EditableWheelWithPth(editable_wheel):  # type: ignore[misc, valid-type]
        def _install_namespaces(self, installation_dir, pth_prefix):  # noqa: ANN001, ANN202
            super()._install_namespaces(installation_dir, pth_prefix)
            _copy_activation_files(installation_dir)

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
