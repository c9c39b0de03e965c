// Declaration-only stand-in for Apple's CoreFoundation umbrella header, which
// is not on Linux. metal-cpp (in the MLX wheel) needs one type from it: the
// time interval of command buffers (CFDate.h declares it as a double).
#pragma once

typedef double CFTimeInterval;
