#!/usr/bin/env python3
"""Convert checkpoints between Hugging Face and megatron-core (also: `megatron-dapo convert ...`).

    python tools/convert_checkpoint.py hf-to-mcore --input HF_DIR --output DIR --tp N --pp M [--ep E]
    python tools/convert_checkpoint.py mcore-to-hf --input DIR --output HF_DIR [--hf-config HF_DIR]
"""

import sys

from megatron_dapo.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
