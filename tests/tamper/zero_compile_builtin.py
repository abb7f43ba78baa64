# compile + a function built from a code object.
import types

src = "def softmax(x):\n    import tfedu.softmax\n    return tfedu.softmax.softmax(x)\n"
softmax = types.FunctionType(compile(src, "x", "exec").co_consts[0], {})
