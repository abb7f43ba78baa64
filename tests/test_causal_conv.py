import pytest
import torch

from tfedu.causal_conv import CausalConvStack, measured_receptive_field, receptive_field


@pytest.mark.parametrize("kernel_size, n_layers", [(2, 1), (2, 4), (3, 3), (4, 2)])
@pytest.mark.parametrize("dilated", [False, True])
def test_gradient_measured_receptive_field_equals_the_formula(kernel_size, n_layers, dilated):
    torch.manual_seed(0)
    model = CausalConvStack(3, kernel_size, n_layers, dilated)
    want = receptive_field(kernel_size, n_layers, dilated)
    assert measured_receptive_field(model, n_pos=want + 10, d_model=3) == want


def test_the_stack_is_causal_and_keeps_the_length(typechecked):
    torch.manual_seed(1)
    model = CausalConvStack(4, 3, 3, dilated=True)
    x = torch.randn(2, 20, 4)
    y = typechecked(model.forward)(x)
    assert y.shape == x.shape
    x2 = x.clone()
    x2[:, 12:] = 5.0  # change the future
    torch.testing.assert_close(model(x2)[:, :12], y[:, :12])


def test_one_layer_equals_conv1d_on_a_left_padded_input():
    torch.manual_seed(2)
    model = CausalConvStack(2, 3, 1, dilated=False)
    x = torch.randn(1, 6, 2)
    conv = model.convs[0]
    padded = torch.cat([torch.zeros(1, 2, 2), x], dim=1)  # two zero positions in front
    want = torch.stack([torch.tanh(torch.einsum("oik,ki->o", conv.weight, padded[0, t:t + 3]) + conv.bias) for t in range(6)])
    torch.testing.assert_close(model(x)[0], want, rtol=1e-5, atol=1e-6)


def test_bad_sizes():
    with pytest.raises(ValueError, match="positive ints"):
        receptive_field(0, 2, True)
