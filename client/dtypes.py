"""Safetensors dtype names (as the manifest records them) to MLX dtypes: for the switch's
segments and the puller's layer shapes alike."""

import mlx.core as mx

MLX_DTYPES = {
    "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32, "U8": mx.uint8,
    "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I32": mx.int32, "U64": mx.uint64,
    "I64": mx.int64, "BOOL": mx.bool_,
}
