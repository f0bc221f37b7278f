"""``import sglang`` in the project's CPU environment, with nothing else to do first.

SGLang 0.5.17 imports triton and torchvision's operators when it is imported; the CPU build of
torch has no triton, and PyPI's torchvision is a CUDA build. :func:`~spexis_sglang.cpu_support
.activate` makes both work, and the launcher, the tests and the benchmarks call it, but a
user's own program (a frontend DSL script, a notebook) does not. ``scripts/setup_cpu_env.sh``
therefore puts ``spexis_sglang_cpu.pth`` into the virtual environment's site-packages; it calls
:func:`install` when the interpreter starts, which only adds a finder to ``sys.meta_path``. At
the first ``import sglang`` the finder takes itself out and activates the CPU support, unless a
CUDA device is usable or the CPU support is already active in this process (the launcher's
children inherit ``SPEXIS_CPU_SUPPORT=1`` and get their hooks from ``shim/sitecustomize.py``).
Nothing is imported before that (this module sits outside ``cpu_support`` so that the
interpreter's start imports nothing but it), so other programs of the environment start as
before.

``SPEXIS_NO_AUTO_CPU_SUPPORT=1`` turns the finder off.
"""

from __future__ import annotations

import os
import sys

# copies of srt.config's ENV_NO_AUTO_CPU_SUPPORT and ENV_CPU_SUPPORT (this module runs at every
# interpreter start and imports nothing of the package)
DISABLE_ENV = "SPEXIS_NO_AUTO_CPU_SUPPORT"
ACTIVE_ENV = "SPEXIS_CPU_SUPPORT"
#: the line of ``spexis_sglang_cpu.pth`` (site runs a ``.pth`` line that starts with
#: ``import``); it never fails the interpreter's start, whatever happened to the package
PTH_LINE = (
    'import sys; exec("try:\\n from spexis_sglang.cpu_import_hook import install'
    '\\n install()\\nexcept Exception:\\n pass")'
)


class FirstSGLangImport:
    """A ``sys.meta_path`` finder that acts once, on the first import of ``sglang``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        try:
            sys.meta_path.remove(self)  # one shot; the imports below must not come back here
        except ValueError:
            pass
        if os.environ.get(ACTIVE_ENV) != "1" and os.environ.get(DISABLE_ENV) != "1":
            try:
                from spexis_sglang.cpu_support import activate

                activate()
            except Exception as e:  # never break the import itself
                sys.stderr.write(f"spexis_sglang: CPU support for SGLang not applied: {e}\n")
        return None  # the ordinary finders import sglang


def install() -> None:
    """Add the finder (once) unless ``SPEXIS_NO_AUTO_CPU_SUPPORT=1``."""
    if os.environ.get(DISABLE_ENV) == "1" or "sglang" in sys.modules:
        return
    if not any(isinstance(f, FirstSGLangImport) for f in sys.meta_path):
        sys.meta_path.insert(0, FirstSGLangImport())


PTH_NAME = "spexis_sglang_cpu.pth"


def write_pth(site_dir: str | None = None) -> str:
    """Write ``spexis_sglang_cpu.pth`` into ``site_dir`` (default: this interpreter's
    site-packages); returns its path. ``scripts/setup_cpu_env.sh`` runs this in the venv."""
    import sysconfig

    site_dir = site_dir or sysconfig.get_paths()["purelib"]
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE + "\n")
    return path


if __name__ == "__main__":
    print(write_pth(sys.argv[1] if len(sys.argv) > 1 else None))
