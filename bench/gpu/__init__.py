"""`specd bench gpu` and the GPU check script (check.sh): the CUDA step measured on random
weights with real models' shapes, since no real weights reach the GPU machine."""
