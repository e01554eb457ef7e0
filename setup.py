"""One distribution that installs the ``adaptive`` library and the ``scheduler`` package."""
from setuptools import find_packages, setup

setup(
    name="adaptive-elastic",
    version="0.2.0",
    description="Elastic, adaptive-batch-size training for PyTorch under torchrun",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["adaptive", "adaptive.*", "scheduler", "scheduler.*"]),
    include_package_data=True,
    package_data={"scheduler": ["data/pollux/README.md", "data/pollux/NOTICE",
                                "data/pollux/*/*.csv", "data/pollux/*/*/*.csv"]},
    install_requires=[
        "torch>=2.4,<2.15",
        "numpy>=1.24",
        "portpicker>=1.5",
        "psutil>=5.9",
        "pyyaml>=6.0",
        "setproctitle>=1.3",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        "report": ["matplotlib>=3.6"],
        "tensorboard": ["tensorboard>=2.12"],
        "examples": ["scikit-learn>=1.2"],
        "ray": ["ray>=2.40"],
        "huggingface": ["accelerate>=1.10", "transformers>=5.0"],
        "lightning": ["lightning>=2.6,<2.7"],
    },
    entry_points={
        "console_scripts": [
            "adaptive-run=adaptive.elastic.launcher:main",
            "adaptive=adaptive.observe.cli:main",
            "adaptive-simulate=scheduler.simulate:main",
            "adaptive-supervisor=scheduler.supervisor.__main__:main",
            "adaptive-executor=scheduler.executor.__main__:main",
        ],
    },
)
