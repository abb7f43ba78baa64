# Kills the kernel with os._exit.
import os

os._exit(0)
