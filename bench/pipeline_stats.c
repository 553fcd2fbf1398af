// Compiler statistics of compute shaders on a Vulkan device (registers, spills,
// shared memory, instruction counts: whatever the driver reports through
// VK_KHR_pipeline_executable_properties), to see why one shader variant runs
// slower than another. NVIDIA's driver reports registers per invocation, which
// set how many workgroups fit on a multiprocessor.
//
//   build: cc -O2 -o /tmp/pipeline_stats bench/pipeline_stats.c -l:libvulkan.so.1
//          (built here and carried, it ran on the H200 machine, which has no compiler
//          headers; run 20 of docs/bench/notes.md)
//   run:   /tmp/pipeline_stats WG ITEMS [ID=VALUE ...] file.spv [file.spv ...]
//          (ID=VALUE: further specialization constants, e.g. attention_dec's 2=2 3=128)
//
// WG and ITEMS are the shaders' specialization constants 0 and 1 (the
// workgroup size and items per workgroup, as vkengine's kernels set them).
// Each file gets a pipeline layout of 8 storage buffers and 256 bytes of push
// constants, a superset of what vkengine's shaders declare. The device is
// created with every feature it reports (Vulkan 1.1-1.3, cooperative matrices
// where present), so any variant's capabilities are there.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vulkan/vulkan.h>

#define CHECK(x) do { VkResult r_ = (x); if (r_ != VK_SUCCESS) { \
    fprintf(stderr, "%s failed: %d\n", #x, (int)r_); exit(1); } } while (0)

static unsigned char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)n);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) { perror(path); exit(1); }
    fclose(f);
    *size = (size_t)n;
    return buf;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s WG ITEMS [ID=VALUE ...] file.spv [file.spv ...]\n", argv[0]);
        return 2;
    }
    int wg = atoi(argv[1]), items = atoi(argv[2]);
    if (wg <= 0 || items <= 0) {
        fprintf(stderr, "WG and ITEMS must be positive integers, not %s and %s\n", argv[1], argv[2]);
        return 2;
    }
    uint32_t spec[16] = {(uint32_t)wg, (uint32_t)items};
    VkSpecializationMapEntry map[16] = {{0, 0, 4}, {1, 4, 4}};
    uint32_t n_spec = 2;
    int first_file = 3;
    for (; first_file < argc && strchr(argv[first_file], '=') && n_spec < 16; first_file++, n_spec++) {
        map[n_spec] = (VkSpecializationMapEntry){(uint32_t)atoi(argv[first_file]), 4 * n_spec, 4};
        spec[n_spec] = (uint32_t)atoi(strchr(argv[first_file], '=') + 1);
    }

    VkApplicationInfo app = {VK_STRUCTURE_TYPE_APPLICATION_INFO, NULL, "pipeline_stats", 1, NULL, 0,
                             VK_API_VERSION_1_3};
    VkInstanceCreateInfo ici = {VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, NULL, 0, &app, 0, NULL, 0, NULL};
    VkInstance inst;
    CHECK(vkCreateInstance(&ici, NULL, &inst));
    uint32_t ndev = 8;
    VkPhysicalDevice devs[8];
    CHECK(vkEnumeratePhysicalDevices(inst, &ndev, devs));
    if (ndev == 0) { fprintf(stderr, "no Vulkan device\n"); return 1; }
    VkPhysicalDevice pd = devs[0];
    VkPhysicalDeviceProperties props;
    vkGetPhysicalDeviceProperties(pd, &props);
    printf("device: %s\n", props.deviceName);

    // every feature the device has, the statistics one included (cooperative
    // matrices where the headers know them: Debian 12's 1.3.239 do not)
#ifdef VK_KHR_cooperative_matrix
    VkPhysicalDeviceCooperativeMatrixFeaturesKHR coop = {
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR};
#define NWANT 3
#else
#define NWANT 1   // the statistics extension only
#endif
    VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR pexe = {
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR, NULL};
    VkPhysicalDeviceVulkan13Features f13 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES, &pexe};
    VkPhysicalDeviceVulkan12Features f12 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, &f13};
    VkPhysicalDeviceVulkan11Features f11 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, &f12};
    VkPhysicalDeviceFeatures2 f2 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, &f11};

    uint32_t next = 0;
    CHECK(vkEnumerateDeviceExtensionProperties(pd, NULL, &next, NULL));
    VkExtensionProperties *exts = malloc(next * sizeof *exts);
    CHECK(vkEnumerateDeviceExtensionProperties(pd, NULL, &next, exts));
    const char *want[] = {VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME,
                          "VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix2"};
    const char *enabled[3];
    uint32_t nen = 0;
    int have_coop = 0, have_stats = 0;
    for (unsigned w = 0; w < NWANT; w++)
        for (uint32_t i = 0; i < next; i++)
            if (!strcmp(exts[i].extensionName, want[w])) {
                enabled[nen++] = want[w];
                if (w == 0) have_stats = 1;
                if (w == 1) have_coop = 1;
            }
    if (!have_stats) {
        fprintf(stderr, "%s lacks VK_KHR_pipeline_executable_properties\n", props.deviceName);
        return 1;
    }
#ifdef VK_KHR_cooperative_matrix
    if (have_coop) pexe.pNext = &coop;
#else
    (void)have_coop;
#endif
    vkGetPhysicalDeviceFeatures2(pd, &f2);
    f13.robustImageAccess = VK_FALSE;   // only what shaders need; robustness would change the code

    uint32_t nq = 16;
    VkQueueFamilyProperties qf[16];
    vkGetPhysicalDeviceQueueFamilyProperties(pd, &nq, qf);
    uint32_t qfi = 0;
    while (qfi < nq && !(qf[qfi].queueFlags & VK_QUEUE_COMPUTE_BIT)) qfi++;
    float prio = 1.0f;
    VkDeviceQueueCreateInfo qci = {VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, NULL, 0, qfi, 1, &prio};
    VkDeviceCreateInfo dci = {VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, &f2, 0, 1, &qci, 0, NULL, nen, enabled, NULL};
    VkDevice dev;
    CHECK(vkCreateDevice(pd, &dci, NULL, &dev));
    PFN_vkGetPipelineExecutablePropertiesKHR getProps =
        (PFN_vkGetPipelineExecutablePropertiesKHR)vkGetDeviceProcAddr(dev, "vkGetPipelineExecutablePropertiesKHR");
    PFN_vkGetPipelineExecutableStatisticsKHR getStats =
        (PFN_vkGetPipelineExecutableStatisticsKHR)vkGetDeviceProcAddr(dev, "vkGetPipelineExecutableStatisticsKHR");

    VkDescriptorSetLayoutBinding binds[8];
    for (uint32_t b = 0; b < 8; b++)
        binds[b] = (VkDescriptorSetLayoutBinding){b, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT,
                                                  NULL};
    VkDescriptorSetLayoutCreateInfo dl = {VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, NULL, 0, 8, binds};
    VkDescriptorSetLayout dsl;
    CHECK(vkCreateDescriptorSetLayout(dev, &dl, NULL, &dsl));
    uint32_t pcs = props.limits.maxPushConstantsSize < 256 ? props.limits.maxPushConstantsSize : 256;
    VkPushConstantRange pcr = {VK_SHADER_STAGE_COMPUTE_BIT, 0, pcs};
    VkPipelineLayoutCreateInfo pl = {VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, NULL, 0, 1, &dsl, 1, &pcr};
    VkPipelineLayout layout;
    CHECK(vkCreatePipelineLayout(dev, &pl, NULL, &layout));
    VkSpecializationInfo si = {n_spec, map, 4 * n_spec, spec};

    for (int a = first_file; a < argc; a++) {
        size_t size;
        unsigned char *code = read_file(argv[a], &size);
        VkShaderModuleCreateInfo smci = {VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, NULL, 0, size,
                                         (const uint32_t *)code};
        VkShaderModule sm;
        CHECK(vkCreateShaderModule(dev, &smci, NULL, &sm));
        VkComputePipelineCreateInfo cpci = {VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, NULL,
                                            VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR,
                                            {VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, NULL, 0,
                                             VK_SHADER_STAGE_COMPUTE_BIT, sm, "main", &si},
                                            layout, VK_NULL_HANDLE, 0};
        VkPipeline pipe;
        VkResult r = vkCreateComputePipelines(dev, VK_NULL_HANDLE, 1, &cpci, NULL, &pipe);
        printf("%s:", argv[a]);
        if (r != VK_SUCCESS) { printf(" pipeline creation failed (%d)\n", (int)r); continue; }
        VkPipelineInfoKHR pi = {VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR, NULL, pipe};
        uint32_t nexe = 0;
        CHECK(getProps(dev, &pi, &nexe, NULL));
        for (uint32_t e = 0; e < nexe; e++) {
            VkPipelineExecutableInfoKHR ei = {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, NULL, pipe, e};
            uint32_t ns = 0;
            CHECK(getStats(dev, &ei, &ns, NULL));
            VkPipelineExecutableStatisticKHR *st = calloc(ns, sizeof *st);
            for (uint32_t s = 0; s < ns; s++) st[s].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR;
            CHECK(getStats(dev, &ei, &ns, st));
            for (uint32_t s = 0; s < ns; s++) {
                printf(" %s=", st[s].name);
                switch (st[s].format) {
                case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: printf("%u", st[s].value.b32); break;
                case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: printf("%lld", (long long)st[s].value.i64); break;
                case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR: printf("%llu", (unsigned long long)st[s].value.u64); break;
                default: printf("%g", st[s].value.f64);
                }
                printf(";");
            }
            free(st);
        }
        printf("\n");
        vkDestroyPipeline(dev, pipe, NULL);
        vkDestroyShaderModule(dev, sm, NULL);
        free(code);
    }
    vkDestroyPipelineLayout(dev, layout, NULL);
    vkDestroyDescriptorSetLayout(dev, dsl, NULL);
    vkDestroyDevice(dev, NULL);
    vkDestroyInstance(inst, NULL);
    return 0;
}
