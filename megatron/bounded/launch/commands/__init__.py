"""The user commands, one module each with its ``main``: the console scripts ``bounded-<name>``
of setup.py and the runners ``tools/<name>.py`` of a clone."""
