"""The dtypes hidden states are stored in at rest (shared/storage/sample_format.py encodes them), in a module of
their own so that the job schema names them without importing torch."""

from typing import Literal

StorageDtype = Literal["bfloat16", "fp8_e4m3"]
