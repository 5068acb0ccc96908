"""Training data on disk: tokenizers (``tokenizer.py``), the text a corpus is read from
(``sources.py``), the token-shard format that ``meshrun data prepare`` writes and ``meshrun
train --data`` reads (``store.py``), and the preparation itself (``prepare.py``). Torch-free:
numpy, the ``tokenizers`` library, and optionally tiktoken, pyarrow and datasets, imported
when used."""

INDEX = "meshrun-data.json"  # a prepared corpus' index, written last
FORMAT = "meshrun-tokens/1"
