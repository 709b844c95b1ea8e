"""How far a stored sample may be from an independent recomputation of it, per storage dtype: plain settings, apart
from the comparison itself (compare.py, which needs torch) so that what records them (an audit's options and report)
reads them without loading torch."""

from pydantic import BaseModel, ConfigDict, Field

from shared.storage.dtypes import StorageDtype


class FieldTolerances(BaseModel):
    """The largest relative error allowed for each aux layer and for the final state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    aux: float = Field(gt=0)
    final: float = Field(gt=0)


class Tolerances(BaseModel):
    """The allowed relative error of a stored sample against an independent recomputation, per storage dtype.

    Measured on SmolLM2-135M-Instruct (30 layers, aux layers 1, 14, 26) with the reference engine on CPU (no GPU
    backend was measured), worst over six prompts of 31 to 517 tokens (chat, code, repeated text, random ids), per
    aux layer 1 / 14 / 26, then final:
        bf16 compute, one prompt alone vs in a padded batch of six    0.003 / 0.013 / 0.021, final 0.027
        bf16 compute vs fp32 compute (also 699 and 1573 tokens)       0.006 / 0.015 / 0.026, final 0.034
        the bf16 state through an fp8_e4m3 round trip, vs fp32        0.023 / 0.027 / 0.034, final 0.041
    (the error grows with depth; fp8's per-token scales add about 0.022 to every layer). The defaults are about twice
    the worst of these: bf16 0.05 / 0.08 (1.9x / 2.3x), fp8 0.07 / 0.10 (2.1x / 2.4x). Defects score far higher on
    the same model: the neighbouring model layer 0.21-0.30, another aux layer 0.71-0.97, another prompt's states
    0.46-0.92, a zeroed state 1.0.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bfloat16: FieldTolerances = FieldTolerances(aux=0.05, final=0.08)
    fp8_e4m3: FieldTolerances = FieldTolerances(aux=0.07, final=0.10)

    def for_dtype(self, storage_dtype: StorageDtype) -> FieldTolerances:
        return {"bfloat16": self.bfloat16, "fp8_e4m3": self.fp8_e4m3}[storage_dtype]


DEFAULT_TOLERANCES = Tolerances()
