"""The presets: one `get_config()` file each, shipped inside the package so that an installed jaxpar has them.

`--config NAME` or `--config configs/NAME.py` loads jaxpar/configs/NAME.py from any working directory
(a file of that path in the working directory wins); jaxpar.config.load_config resolves them.
"""
