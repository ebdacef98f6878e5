"""The one compiled part of guardfs: guardfs/_fusereply.c (see its header for why).

Everything else is declared in pyproject.toml; setuptools reads this file only for the
extension, which links libfuse3 (libfuse3-dev, which pyfuse3's own build needs too).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("guardfs._fusereply", ["guardfs/_fusereply.c"], libraries=["fuse3"])])
