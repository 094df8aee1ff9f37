"""Only what pyproject.toml cannot say: install `runner-lm-eval.pth` next to the packages, in
wheels and in editable installs alike, so lm-eval's command line finds `--model runner`
(see _runner_lm_eval.py). Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "runner-lm-eval.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        # An editable install puts only links in its wheel: the .pth goes to that wheel's root.
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(PTH, os.path.join(target, PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
