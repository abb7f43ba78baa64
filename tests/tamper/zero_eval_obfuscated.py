# eval of an obfuscated expression.
code = "".join(chr(c) for c in [95, 95, 105, 109, 112, 111, 114, 116, 95, 95])
softmax = eval(code + "('tfedu.softmax', fromlist=['s']).softmax")
