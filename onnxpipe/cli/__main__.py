"""``python -m onnxpipe.cli``: the same as the ``onnxpipe`` command."""

from onnxpipe.cli._main import main

if __name__ == "__main__":
    main(prog_name="onnxpipe")
