"""What the int4/int8 GEMVs can multiply their weights with, and the kernels' switch for each.

"float": x in float32; "int8": x rounded to int8 per 32 columns, DP4A (A8, kernels.int8_inputs);
"fp16": x scaled per 32 columns to fp16, packed fp16 arithmetic (H16, kernels.half_math);
"int16": x in 16-bit fixed point per 32 columns, sums exact by DP2A (I16, kernels.int16_inputs).
"""

# the constexpr switch of each kind but "float", in the order of the GEMV kernels' autotune keys
INPUT_SWITCHES = {"int8": "A8", "fp16": "H16", "int16": "I16"}
QUANT_INPUTS = ("float", *INPUT_SWITCHES)
# what people read for each kind but "float" (bench stage names, generate's line)
QUANT_INPUT_LABELS = {"int8": "int8 inputs", "fp16": "fp16 arithmetic", "int16": "int16 inputs"}


def switches(inputs: str) -> dict[str, bool]:
    """The kernels' switches for `inputs` (one of QUANT_INPUTS)."""
    if inputs not in QUANT_INPUTS:
        raise ValueError(f"GEMV inputs {inputs!r}: not one of {', '.join(QUANT_INPUTS)}")
    return {switch: inputs == kind for kind, switch in INPUT_SWITCHES.items()}


def from_switches(args: dict) -> str:
    """The kind whose switch is on in a launch's arguments (A8/H16/I16), else "float"."""
    return next((kind for kind, switch in INPUT_SWITCHES.items() if args.get(switch)), "float")
