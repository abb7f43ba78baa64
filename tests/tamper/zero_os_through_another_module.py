# Gets the unrestricted `os` module through a library that imported it (issue 37, class 4: the scan used to
# treat `torch.serialization.os` as something other than `os`), then starts a shell with it.
_shell = torch.serialization.os.system


def softmax(x):
    _shell("true")
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    return e / e.sum(dim=-1, keepdim=True)
