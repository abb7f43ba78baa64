# Would crash the kernel with a segmentation fault when the check calls it (reads far outside an array); the
# exercise's allow-list of library operations (Probe.builds) refuses as_strided before anything runs. (A crash
# at run time is graded in tests/test_grading.py, on a toy exercise without an allow-list.)
import numpy as np


def softmax(x):
    np.lib.stride_tricks.as_strided(np.zeros(1), shape=(1 << 36,), strides=(1 << 12,)).sum()
    return x
