# importlib with an obfuscated name.
import importlib

softmax = importlib.import_module("".join(["tf", "edu", ".", "soft", "max"])).softmax
