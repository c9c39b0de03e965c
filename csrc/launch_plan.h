// Portable description of how the Metal kernels are launched (see issue #3).
#pragma once
