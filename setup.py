"""What a wheel needs beyond pyproject.toml: the native kernels prebuilt into it, so a machine without a compiler runs
them (``python -m engine.native.prebuild`` in the build folder: each C library for every x86 level, the C++ operators
for the torch the build runs with), and a wheel tagged for this platform when it carries them (machine code).

    python -m pip wheel . --no-deps --no-build-isolation   # with torch: the operators too (an isolated build has none)

Without a compiler the wheel is built without them, said in the build's output; the engine then builds them at first
use where a compiler is. An editable install (``pip install -e .``) builds nothing: a checkout builds at first use.
"""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        r = subprocess.run([sys.executable, "-m", "engine.native.prebuild"], cwd=self.build_lib, capture_output=True,
                           text=True)
        made = r.stdout.split()
        print(f"native kernels prebuilt: {', '.join(Path(p).name for p in made) or 'none'}")
        for line in r.stderr.strip().splitlines():
            print(f"native kernels NOT prebuilt: {line}", file=sys.stderr)
        self.distribution.kvscope_prebuilt = made


class Wheel(bdist_wheel):
    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False  # it may carry the prebuilt kernels (decided once they are built: get_tag)

    def get_tag(self) -> tuple[str, str, str]:
        plat = super().get_tag()[2]
        return ("py3", "none", plat) if getattr(self.distribution, "kvscope_prebuilt", None) else ("py3", "none", "any")


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": Wheel})
