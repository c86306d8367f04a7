"""The forward on a GPU: Triton kernels for attention read in place from the paged pool and
for a layer's element-wise work, GEMMs of one fixed row count (so every row rounds alike),
and decode/verification steps replayed from CUDA graphs (`step.GpuStep`). Every kernel
also runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how `make test`
checks them on a CPU."""

# every launch says whether its kernel fuses multiplies and adds: yes, as Triton 3.9
# compiles by default, said so that a Triton whose default differs (3.10's is off) compiles
# the same arithmetic, and none warns of it at start
FP_FUSION = {"enable_fp_fusion": True}
