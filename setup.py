"""What pyproject.toml cannot say: the top-level conf/ ships inside the package as
trainer/conf (the one copy of the configs), beside the discovered packages."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["trainer", "trainer.*"]), "trainer.conf"],
    package_dir={"trainer.conf": "conf"},
)
