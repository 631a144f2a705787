"""Packaging hook only (all metadata is in ``pyproject.toml``): ship ``_megatrain_ds_hook.pth``.

A ``.pth`` file in ``site-packages`` whose line starts with ``import`` runs at interpreter
start-up; this one registers the import watcher of ``_megatrain_ds_hook`` so that
``"engine": "megatrain"`` configs are routed without ``import megatrain_ds`` (see that
module). ``build_py`` writes the file to the root of what becomes the wheel:

- regular wheel: ``build_lib``, which ``bdist_wheel`` installs into its tree as is;
- editable wheel (``pip install -e``, PEP 660): setuptools' ``editable_wheel`` ignores
  ``build_lib`` (modules are mapped to the checkout) but packs its ``install_lib``, the
  unpacked wheel, into the wheel, so the file goes there.

``tests/test_deepspeed_hook.py`` (``test_both_wheel_kinds_ship_the_pth_at_their_root``) builds
both kinds and checks the file is at the root.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "_megatrain_ds_hook.pth"
# Sorted after setuptools' "__editable__.*.pth" (which must map the module first in an
# editable install); MEGATRAIN_DISABLE_HOOK=1 is checked inside install().
PTH_LINE = "import _megatrain_ds_hook; _megatrain_ds_hook.install()\n"


class build_py_with_hook(build_py):
    def run(self) -> None:
        super().run()
        editable = self.editable_mode
        target = Path(self.get_finalized_command("install").install_lib if editable else self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE, encoding="utf-8")


setup(cmdclass={"build_py": build_py_with_hook})
