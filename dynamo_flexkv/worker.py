"""``python -m dynamo_flexkv.worker``: the Dynamo worker component (see dynamo_flexkv.dynamo.worker)."""

from dynamo_flexkv.dynamo.worker import main

if __name__ == "__main__":
    main()
