"""pip install . : the Python package `pstrain` (the client library's module,
pstrain.torch), built with the project's CMake build, without the network:

    python3 -m venv --system-site-packages /tmp/venv
    /tmp/venv/bin/pip install --no-build-isolation .

The build directory is PSTRAIN_BUILD_DIR, default build/ (deploy/build.sh
makes it with the Debian packages it needs); only the module and the
client library are built there, and both are copied into the package.
"""
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = os.path.abspath(os.environ.get("PSTRAIN_BUILD_DIR", os.path.join(HERE, "build")))
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            subprocess.check_call(["cmake", "-S", HERE, "-B", build, "-G", "Ninja",
                                   "-DCMAKE_BUILD_TYPE=RelWithDebInfo"])
        subprocess.check_call(["cmake", "--build", build, "--target", "pstrain_python"])
        target = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(target, exist_ok=True)
        # The module finds the client library beside it ($ORIGIN).
        for path in glob.glob(os.path.join(build, "python", "pstrain", "_client*.so")) + \
                glob.glob(os.path.join(build, "lib", "libpstrain_client.so.[0-9]")):
            shutil.copy2(path, target, follow_symlinks=True)


setup(
    name="pstrain",
    version="0.1.0",
    description="pstrain's client library: train your own (PyTorch) model on pstrain's "
                "parameter servers",
    packages=["pstrain"],
    package_dir={"pstrain": "worker/python/pstrain"},
    ext_modules=[Extension("pstrain._client", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own build files beside CMake's, not among them.
    options={"build": {"build_base": os.path.join("build", "setuptools")}},
    python_requires=">=3.9",
)
