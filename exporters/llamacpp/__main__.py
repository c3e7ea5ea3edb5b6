"""`python -m exporters.llamacpp setup | convert | convert-server | serve`: llama.cpp's converter
fetched (make setup), one conversion, the converter's child process, llama.cpp's child process."""

import sys

from exporters.llamacpp.converter import convert_main, convert_server
from exporters.llamacpp.runtime import serve
from exporters.llamacpp.setup import setup

if sys.argv[1:2] == ["setup"]:
    print(setup())
elif sys.argv[1:2] == ["convert"]:
    convert_main(*sys.argv[2:5])
elif sys.argv[1:2] == ["convert-server"]:
    convert_server(sys.argv[2])
elif sys.argv[1:2] == ["serve"]:
    serve(*sys.argv[2:8])
else:
    print("usage: python -m exporters.llamacpp setup | convert MODEL_DIR OUT.gguf OUTTYPE", file=sys.stderr)
    sys.exit(2)
