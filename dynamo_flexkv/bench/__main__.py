import sys

from dynamo_flexkv.bench import main

sys.exit(main())
