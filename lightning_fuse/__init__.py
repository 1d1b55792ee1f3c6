"""lightning-fuse: FP8 Linear -> bias -> activation chains with a one-kernel fused backward."""
