"""Print transformers' GlmMoeDsaConfig.indexer_types for each keyword-argument set of a JSON list."""

import json
import sys

from transformers import GlmMoeDsaConfig


def main() -> None:
    print(json.dumps([GlmMoeDsaConfig(**kwargs).indexer_types for kwargs in json.loads(sys.argv[1])]))


if __name__ == "__main__":
    main()
