"""hpcmem packaging.

templates/, site_configs/ and jobs/ live at the top of the repository (that is where
people edit them); a wheel carries copies inside the package as toolkit/_data/<name>/,
which toolkit/resources.py finds when the package is not a source checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
DATA_DIRS = ("templates", "site_configs", "jobs")


class BuildWithData(build_py):
    """build_py that also copies the data directories into toolkit/_data/."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable install reads them from the checkout
        for name in DATA_DIRS:
            target = Path(self.build_lib) / "toolkit" / "_data" / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(HERE / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithData})
