// Declaration-only stand-in for Apple's IOSurfaceRef.h: metal-cpp only passes
// the opaque IOSurface handle around.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
