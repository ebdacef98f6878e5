"""The one compiled part of guardfs: guardfs/_fusereply.c (see its header for why).

Everything else is declared in pyproject.toml; setuptools reads this file only for the
extension, which links libfuse3 (libfuse3-dev, which pyfuse3's own build needs too).

The extension uses only the limited C API (a module of three functions returning ints), so
it is built against the stable ABI of the oldest Python guardfs supports (requires-python):
one wheel, tagged ``abi3``, serves that Python and every later one.
"""

from setuptools import Extension, setup

#: The oldest Python of requires-python, as Py_LIMITED_API's hex and the wheel's tag.
LIMITED_API = (0x030B0000, "cp311")

setup(
    ext_modules=[Extension("guardfs._fusereply", ["guardfs/_fusereply.c"], libraries=["fuse3"],
                           define_macros=[("Py_LIMITED_API", hex(LIMITED_API[0]))], py_limited_api=True)],
    options={"bdist_wheel": {"py_limited_api": LIMITED_API[1]}},
)
